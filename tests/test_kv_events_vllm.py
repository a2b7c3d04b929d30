"""Our stream and hashes against vLLM 0.33's own code (``tests/vllm_reference.py``), when its sources
are unpacked where the cache peers' harness puts them (``$PEERS_SRC``, default ``/tmp/peers/src``)
and ``cbor2`` (a vLLM dependency) is installed; skipped otherwise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(os.environ.get("PEERS_SRC", "/tmp/peers/src"))
pytestmark = pytest.mark.skipif(
    not (SRC / "vllm/distributed/kv_events.py").is_file() or importlib.util.find_spec("cbor2") is None,
    reason=f"vLLM sources not in {SRC} (the peers' setup.sh unpacks them) or cbor2 missing",
)


@pytest.fixture(scope="module")
def reference() -> dict:
    script = Path(__file__).with_name("vllm_reference.py")
    env = {**os.environ, "PEERS_SRC": str(SRC)}
    env.pop("PYTHONHASHSEED", None)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_encodes_the_same_bytes_and_each_side_decodes_the_other(reference: dict) -> None:
    assert reference["same_bytes"] and reference["vllm_decodes_ours"] and reference["we_decode_theirs"]


def test_vllm_hash_scheme_matches_vllm_hash_block_tokens(reference: dict) -> None:
    assert {case: same for case, (same, _) in reference["hashes"].items()} == dict.fromkeys(
        reference["hashes"], True
    )
    assert len(reference["hashes"]) == 12  # 2 algorithms x 3 seeds x with and without a cache_salt


def test_index_follows_a_vllm_publisher(reference: dict) -> None:
    """Stored 2 pages, removed the second, then cleared and stored both in one batch."""
    assert reference["followed"] == [[8, 0], [4, 0], [8, 0]]
    assert reference["counters"]["malformed"] == 0 and reference["counters"]["batches"] == 3
