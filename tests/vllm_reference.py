"""vLLM's own code as the reference for our wire format and for the vLLM hash scheme.

Run as a script (``python tests/vllm_reference.py``) by ``tests/test_kv_events_vllm.py``: it imports
``vllm/distributed/kv_events.py``, ``vllm/v1/core/kv_cache_utils.py`` and ``vllm/utils/hashing.py``
from vLLM's sources in ``$PEERS_SRC`` (default ``/tmp/peers/src``, where the cache peers' harness
unpacks the vllm 0.33.0 wheel), every other ``vllm`` module replaced by a stub (they pull in the
serving stack, and none of them takes part in these functions). Prints one JSON object of checks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import types
from pathlib import Path
from types import SimpleNamespace

SRC = Path(os.environ.get("PEERS_SRC", "/tmp/peers/src"))
REAL = {"vllm.utils.hashing", "vllm.v1.core.kv_cache_utils", "vllm.distributed.kv_events"}


class _Anything:
    """Stands in for any attribute of a stubbed module: callable, subscriptable, a base class."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args: object, **kwargs: object) -> object:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

    def __getitem__(self, item: object) -> object:
        return _Anything()

    def __or__(self, other: object) -> object:
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return logging.getLogger if name == "init_logger" else _Anything()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        if fullname in REAL:
            return importlib.util.spec_from_file_location(
                fullname, SRC / (fullname.replace(".", "/") + ".py")
            )
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _vllm_keys(kcu, hashing, algo: str, seed: str | None, tokens: list[int], page_size: int, salt):
    """vLLM's block hashes of ``tokens`` as its events publish them (ints)."""
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    hash_fn = hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(hash_fn)
    request = SimpleNamespace(mm_features=[], lora_request=None, cache_salt=salt, prompt_embeds=None)
    keys, parent = [], None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        extra, _ = kcu.generate_block_hash_extra_keys(request, start, start + page_size, 0)
        parent = kcu.hash_block_tokens(hash_fn, parent, tokens[start : start + page_size], extra)
        keys.append(kcu.maybe_convert_block_hash(parent))
    return keys


def main() -> None:
    sys.meta_path.insert(0, _Finder())
    import msgspec
    import vllm.distributed.kv_events as ke
    import vllm.utils.hashing as hashing
    import vllm.v1.core.kv_cache_utils as kcu

    from prefix_cache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
    from prefix_cache.events.index import BlockIndex, block_hashes
    from prefix_cache.events.schemes import VllmHash
    from prefix_cache.events.subscriber import KVEventSubscriber
    from prefix_cache.events.wire import BatchDecoder, to_wire

    out: dict[str, object] = {}
    # 1. Bytes: vLLM's encoder and ours on the same events.
    ours = [
        BlockStored([5, 2**64 - 1], None, [1, 2, 1000, 70000], 2),
        BlockStored([6], 5, [3, 4], 2, extra_keys=[b"\x01\x00\x00\x00x"]),
        BlockRemoved([5]),
        BlockStored([7], 6, [5, 6], 2, medium="CPU"),  # the host tier
        BlockRemoved([7], medium="CPU"),
        AllBlocksCleared(),
    ]
    theirs = ke.KVEventBatch(
        ts=1.5,
        events=[
            ke.BlockStored([5, 2**64 - 1], None, [1, 2, 1000, 70000], 2, None, "GPU", None),
            ke.BlockStored([6], 5, [3, 4], 2, None, "GPU", None, extra_keys=[(b"\x01\x00\x00\x00x",)]),
            ke.BlockRemoved([5], "GPU"),
            ke.BlockStored([7], 6, [5, 6], 2, None, ke.MEDIUM_CPU, None),
            ke.BlockRemoved([7], ke.MEDIUM_CPU),
            ke.AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    their_bytes = msgspec.msgpack.encode(theirs)
    our_bytes = msgspec.msgpack.encode(to_wire(ours, 1.5, 1))
    out["same_bytes"] = their_bytes == our_bytes
    out["vllm_decodes_ours"] = msgspec.msgpack.Decoder(ke.KVEventBatch).decode(our_bytes) == theirs
    out["we_decode_theirs"] = BatchDecoder().decode(their_bytes) == (1.5, ours, 1)

    # 2. Hashes: vLLM's hash_block_tokens against VllmHash, for each algorithm and seed.
    tokens = [128000, 9906, 1917, 0, 5, 70000, 3, 3, 12, 99, 100, 2**31 - 1, 7]
    agree = {}
    for algo in ("sha256", "sha256_cbor"):
        for seed in (None, "0", "12345"):
            for salt in (None, "tenant-a"):
                want = _vllm_keys(kcu, hashing, algo, seed, tokens, 4, salt)
                got = block_hashes(tokens, 4, salt, scheme=VllmHash(algo, seed))
                agree[f"{algo}/{seed}/{salt}"] = (want == got, want)
    out["hashes"] = agree

    # 3. vLLM's ZmqEventPublisher, followed by our subscriber into a BlockIndex with its scheme.
    os.environ.pop("PYTHONHASHSEED", None)
    kcu.init_none_hash(hashing.sha256)
    folder = tempfile.mkdtemp(prefix="kv-events-")
    pub = ke.ZmqEventPublisher(0, f"ipc://{folder}/pub", f"ipc://{folder}/replay")
    index = BlockIndex(2, 4, schemes=[VllmHash(), VllmHash("sha256_cbor")])
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    keys = _vllm_keys(kcu, hashing, "sha256", None, prompt, 4, None)
    with KVEventSubscriber(index, replay_timeout=2.0) as sub:
        sub.connect(0, f"ipc://{folder}/pub", f"ipc://{folder}/replay")
        time.sleep(0.3)
        batches = [
            [ke.BlockStored(keys, None, prompt[:8], 4, None, "GPU", None)],
            [ke.BlockRemoved(keys[1:], "GPU")],
            [ke.AllBlocksCleared(), ke.BlockStored(keys, None, prompt[:8], 4, None, "GPU", None)],
        ]
        seen = []
        for events in batches:
            pub.publish(ke.KVEventBatch(ts=time.time(), events=events))
            deadline = time.monotonic() + 5
            while sub.next_seq(0) < len(seen) + 1 and time.monotonic() < deadline:
                sub.poll(0.05)
            seen.append(index.match(prompt))
        out["followed"] = seen
        out["counters"] = vars(sub.counters(0))
    pub.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
