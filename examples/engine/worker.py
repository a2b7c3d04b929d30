"""The engine's thread behind the server: requests and aborts in through a queue, events out through
per-request asyncio queues, metrics and the periodic log line recorded after each step.

No request can stop the thread: the engine fails a request whose sampling raises, or the batch whose
forward raises (``LLMEngine.step``); anything else that escapes a step fails the requests in flight,
is logged with its traceback, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future

import torch

from .engine import LLMEngine
from .metrics import EngineMetrics
from .request import Request, Sample, SamplingParams

log = logging.getLogger("examples.engine.server")

#: Event codes in place of a sample index: (CACHED, prompt tokens found cached, None, None) comes
#: before sample 0's first token; (ERROR, message, None, None) ends a failed request.
CACHED, ERROR = -1, -2


class EngineWorker:
    """Runs ``engine.step`` in a thread; ``submit`` and ``abort`` may be called from any thread.

    A request's events are (sample index, token id, finish reason or None, logprob entry or None),
    or one of the coded events above."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics, log_interval: float = 10.0) -> None:
        self.engine, self.metrics, self.log_interval = engine, metrics, log_interval
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._stop = False
        # OpenMP's thread count is per thread: the engine thread takes the one set where it is created.
        self._num_threads = torch.get_num_threads()
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (what /health reports)."""
        return self._thread.is_alive() and not self._stop

    def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue, Future]:
        """Queue a request; returns its id, the queue its events arrive on, and a future that fails
        with the engine's ValueError if it is refused."""
        request_id, events, accepted = uuid.uuid4().hex, asyncio.Queue(), Future()
        self._commands.put(("add", request_id, prompt, params, asyncio.get_running_loop(), events, accepted))
        return request_id, events, accepted

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Stop the request (or its sample ``index``) and send it nothing more (see LLMEngine.abort)."""
        self._commands.put(("abort", request_id, index, reason))

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(("wake",))
        self._thread.join()

    def _loop(self) -> None:
        torch.set_num_threads(self._num_threads)
        self.metrics.on_step(self.engine, 0, 0)  # the cache's counters and pages before any request
        while not self._stop:
            try:
                self._iterate()
            except Exception as error:  # the thread must outlive any one failure
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(f"{type(error).__name__}: {error}")

    def _iterate(self) -> None:
        engine = self.engine
        try:
            block = not engine.has_work()
            while True:
                self._handle(self._commands.get(block=block, timeout=self.log_interval if block else None))
                block = False
        except queue.Empty:
            pass
        samples = engine.step()
        now = time.perf_counter()
        prefilled = 0
        for sample in samples:
            if sample.index == 0 and sample.num_output == 1 and sample.finish_reason != "error":
                prefilled += len(sample.request.prompt)
        new_tokens = sum(s.finish_reason != "error" for s in samples)
        self.metrics.on_step(engine, new_tokens, prefilled)
        # The metrics of the requests this step ended are recorded before their last tokens go out,
        # so a client that reads /metrics after its response sees them; several samples of one
        # request may end in the same step, so a request is recorded once.
        ended = {}
        for sample in samples:
            request = sample.request
            if request.finished and request.request_id in self._streams:
                ended[request.request_id] = request
        for request in ended.values():
            self.metrics.on_finished(request, now)
            if request.error is not None:
                log.warning("request %s failed in the engine: %s", request.request_id, request.error)
        for sample in samples:
            self._publish(sample)
        for request_id in ended:
            del self._streams[request_id]
        line = self.metrics.log_line(self.log_interval)
        if line:
            log.info(line)

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, prompt, params, loop, events, accepted = command
            try:
                self.engine.add_request(prompt, params, request_id)
            except Exception as error:  # refused: the handler answers 4xx
                accepted.set_exception(error)
                return
            self._streams[request_id] = (loop, events)
            accepted.set_result(None)
        elif command[0] == "abort":
            _, request_id, index, reason = command
            request = self.engine.requests.get(request_id)
            self.engine.abort(request_id, index, reason)
            if request is not None and request.finished and self._streams.pop(request_id, None):
                self.metrics.on_finished(request, time.perf_counter())

    def _publish(self, sample: Sample) -> None:
        request: Request = sample.request
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        loop, events = stream
        if sample.finish_reason == "error":
            loop.call_soon_threadsafe(events.put_nowait, (ERROR, request.error, None, None))
            return
        if sample.index == 0 and sample.num_output == 1:
            loop.call_soon_threadsafe(events.put_nowait, (CACHED, request.cached_tokens, None, None))
        logprob = sample.logprobs[-1] if request.params.logprobs is not None else None
        event = (sample.index, int(sample.output[-1]), sample.finish_reason, logprob)
        loop.call_soon_threadsafe(events.put_nowait, event)

    def _fail_all(self, message: str) -> None:
        """Abort every request in flight and send each an ERROR event."""
        for request_id, (loop, events) in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            finally:
                loop.call_soon_threadsafe(events.put_nowait, (ERROR, message, None, None))
        self._streams.clear()
