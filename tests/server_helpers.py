"""Starting the OpenAI-compatible server in this process on a free loopback port (the server tests)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serve(app: object) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread; yields its base URL ("http://127.0.0.1:PORT")."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def request(
    base_url: str, method: str, path: str, body: object = None, timeout: float = 120
) -> tuple[int, bytes]:
    """One raw HTTP request (``body``: bytes as they are, anything else as JSON); (status, body)."""
    import http.client
    import json
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
