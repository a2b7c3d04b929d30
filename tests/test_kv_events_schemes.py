"""Block hash schemes: vLLM's recipe on vectors computed here, and a router index over a mixed fleet
(this library's replicas and vLLM 0.33 replicas) fed through the wire."""

from __future__ import annotations

import hashlib
import pickle
import time

import numpy as np
import pytest
from test_kv_events_helpers import (
    LOOPBACK,
    Engine,
    FakeReplica,
    VllmAllBlocksCleared,
    VllmBlockStored,
    vllm_payload,
)

from prefix_cache.events.index import BlockIndex, block_hashes
from prefix_cache.events.publisher import KVEventPublisher
from prefix_cache.events.schemes import PrefixCacheHash, VllmHash, cbor
from prefix_cache.events.subscriber import KVEventSubscriber

TOKENS = [128000, 9906, 1917, 0, 5, 70000, 3, 3, 12, 99, 100, 2**31 - 1, 7]
#: vLLM 0.33's ``hash_block_tokens`` on ``TOKENS`` at block size 4, published as ints
#: (``tests/vllm_reference.py`` recomputes them with vLLM's code when its sources are at hand).
VLLM_VECTORS = {
    ("sha256", None, None): [13638738611979467251, 1147139007107125332, 15575242087077325349],
    ("sha256", "0", "tenant-a"): [2246780455554581175, 949500961217909278, 13028753011834688275],
    ("sha256_cbor", None, None): [17800502767236038314, 5798326671560476241, 8930772858672429834],
    ("sha256_cbor", "12345", "tenant-a"): [394517778142198176, 2294213613635780169, 415396960683323465],
}


@pytest.mark.parametrize(("algo", "seed", "salt"), list(VLLM_VECTORS))
def test_vllm_scheme_reproduces_vllm_vectors(algo: str, seed: str | None, salt: str | None) -> None:
    assert block_hashes(TOKENS, 4, salt, scheme=VllmHash(algo, seed)) == VLLM_VECTORS[algo, seed, salt]


def _u64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def test_sha256_cbor_recipe_written_out_byte_by_byte() -> None:
    """The documented recipe with the CBOR written by hand: NONE_HASH = sha256(cbor("vllm-none-hash")),
    block = sha256(cbor([parent, [tokens...], extra])), published as its last 8 bytes."""
    none_hash = hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()  # a text string of 14 bytes
    # [bytes(32), [1, 2, 24, 1000], nil]: 24 takes a one-byte argument, 1000 a two-byte one.
    first = hashlib.sha256(b"\x83\x58\x20" + none_hash + b"\x84\x01\x02\x18\x18\x19\x03\xe8\xf6").digest()
    # [first, [70000, 0, 23, 23], nil]: 70000 takes four bytes, 23 fits in the head.
    second = hashlib.sha256(b"\x83\x58\x20" + first + b"\x84\x1a\x00\x01\x11\x70\x00\x17\x17\xf6").digest()
    scheme = VllmHash("sha256_cbor")
    assert block_hashes([1, 2, 24, 1000, 70000, 0, 23, 23], 4, scheme=scheme) == [_u64(first), _u64(second)]
    # A cache_salt "x" is the first block's extra keys, [["cache_salt", "x"]]; later blocks have none.
    salt = b"\x81\x82\x6acache_salt\x61x"
    salted = hashlib.sha256(b"\x83\x58\x20" + none_hash + b"\x84\x01\x02\x18\x18\x19\x03\xe8" + salt).digest()
    then = hashlib.sha256(b"\x83\x58\x20" + salted + b"\x84\x1a\x00\x01\x11\x70\x00\x17\x17\xf6").digest()
    assert block_hashes([1, 2, 24, 1000, 70000, 0, 23, 23], 4, "x", scheme=scheme) == [
        _u64(salted),
        _u64(then),
    ]
    assert cbor((None, True, -1, -25, b"", "", [])) == b"\x87\xf6\xf5\x20\x38\x18\x40\x60\x80"
    with pytest.raises(TypeError, match="cbor"):
        cbor(1.5)


def test_sha256_recipe_is_the_pickle_of_the_tuple() -> None:
    none_hash = hashlib.sha256(pickle.dumps("7", protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((none_hash, (5, 6, 300, 70000), None), protocol=5)).digest()
    assert block_hashes(np.array([5, 6, 300, 70000, 1]), 4, scheme=VllmHash("sha256", "7")) == [_u64(first)]


def test_vllm_scheme_refuses_what_it_cannot_follow() -> None:
    with pytest.raises(ValueError, match="algo"):
        VllmHash("xxhash")
    with pytest.raises(TypeError, match="seed"):
        VllmHash("sha256", 7)
    # Keys vLLM derives from state a router does not have: no keys, so no (false) hits.
    assert block_hashes(TOKENS, 4, scheme=VllmHash(), extra_keys=[(0, 4, b"img")]) == []
    assert block_hashes(TOKENS, 4, b"bytes-namespace", scheme=VllmHash()) == []
    with pytest.raises(ValueError, match="schemes"):
        BlockIndex(2, 4, schemes=[VllmHash()])
    with pytest.raises(TypeError, match="schemes"):
        BlockIndex(1, 4, schemes=["sha256"])


def test_index_follows_a_mixed_fleet_through_the_wire() -> None:
    """Replica 0 is this library's engine and publisher; replica 1 a vLLM 0.33 engine (sha256_cbor,
    PYTHONHASHSEED=12345) sending its own wire format; one router index follows both."""
    engine = Engine(seed=21, num_pages=200)
    scheme = VllmHash("sha256_cbor", "12345")
    vllm_keys = VLLM_VECTORS["sha256_cbor", "12345", "tenant-a"]
    salted = block_hashes(TOKENS, 4, "tenant-a", scheme=scheme)
    plain = block_hashes(TOKENS, 4, scheme=scheme)
    batches = {
        0: vllm_payload([VllmBlockStored(vllm_keys, None, TOKENS[:12], 4, None, "GPU", None)]),
        1: vllm_payload([VllmBlockStored(plain[:2], None, TOKENS[:8], 4, None, "GPU", None)]),
        2: vllm_payload(
            [VllmAllBlocksCleared(), VllmBlockStored(plain, None, TOKENS[:12], 4, None, "GPU", None)]
        ),
    }
    assert salted == vllm_keys
    index = BlockIndex(num_replicas=2, page_size=4, schemes=[PrefixCacheHash(), scheme])
    replica = FakeReplica(batches, topic=b"")
    try:
        with KVEventPublisher(LOOPBACK, LOOPBACK) as pub, KVEventSubscriber(index, replay_timeout=2.0) as sub:
            sub.connect(0, pub.endpoint, pub.replay_endpoint)
            sub.connect(1, replica.endpoint, replica.replay_endpoint)
            time.sleep(0.3)
            for step in range(40):
                pub.publish(engine.step())
                if step == 5:
                    replica.send(0)
                    replica.send(1)
            while sub.next_seq(1) < 2:
                replica.send(1)
                sub.poll(0.05)
            sub.wait_for({0: pub.next_seq})
            assert index.match([*TOKENS[:12], 0], "tenant-a") == [
                engine.cache.match([*TOKENS[:12], 0], "tenant-a"),
                12,
            ]
            assert index.match([*TOKENS[:12], 0])[1] == 8
            for tokens, namespace in engine.probes(5):
                assert index.match(tokens, namespace)[0] == engine.cache.match(tokens, namespace)
            while sub.next_seq(1) < 3:
                replica.send(2)
                sub.poll(0.05)
            assert index.match([*TOKENS[:12], 0], "tenant-a")[1] == 0  # cleared in the same batch
            assert index.match([*TOKENS[:12], 0])[1] == 12  # stored after the clear
            assert sub.counters(1).malformed == 0
    finally:
        replica.close()
