"""Extra keys (multimodal content hashes, over token ranges) as part of block identity."""

from __future__ import annotations

import numpy as np
import pytest
from test_cache_helpers import snapshot
from xxhash import xxh3_64_intdigest

from prefix_cache.cache.events import AllBlocksCleared, BlockStored
from prefix_cache.cache.hashing import namespace_seed
from prefix_cache.cache.prefix_cache import PrefixCache

PROMPT = list(range(100, 113))  # 13 tokens: pages 0-2 full at page size 4, token 12 on its own
IMAGE_A = [(5, 9, b"image-a")]  # placeholder tokens 5..8: pages 1 and 2
IMAGE_B = [(5, 9, b"image-b")]


def admit_all(cache: PrefixCache, prompt, extra_keys=None, close: bool = True):
    seq = cache.admit(prompt, extra_keys=extra_keys)
    cache.commit(seq, prompt[seq.num_cached_tokens :])
    if close:
        cache.close(seq)
    cache.check_invariants()
    return seq


def identity(tokens: list[int], *keys: bytes) -> bytes:
    """A page's identity bytes, as documented in prefix_cache.cache.hashing."""
    extra = b"".join(len(key).to_bytes(4, "little") + key for key in keys)
    return np.asarray(tokens, dtype=np.int32).tobytes() + extra


def test_equal_tokens_with_other_images_share_only_the_pages_before_them() -> None:
    cache = PrefixCache(num_pages=32, page_size=4)
    admit_all(cache, PROMPT, IMAGE_A)
    assert cache.match(PROMPT, extra_keys=IMAGE_A) == 12
    assert cache.match(PROMPT, extra_keys=IMAGE_B) == 4  # page 0 holds no image token
    assert cache.match(PROMPT) == 4  # nor does a prompt without the image match its pages
    seq = admit_all(cache, PROMPT, IMAGE_B, close=False)
    assert seq.num_cached_tokens == 4
    assert cache.match(PROMPT, extra_keys=IMAGE_B) == 12
    cache.close(seq)
    cache.check_invariants()


def test_keys_and_events_follow_the_documented_hash() -> None:
    cache = PrefixCache(num_pages=32, page_size=4)
    seq = cache.admit(PROMPT, extra_keys=[(5, 9, b"image-a"), (8, 10, "caption")], extra_tokens=3)
    cache.commit(seq, PROMPT)
    cache.commit(seq, [7, 7, 7])  # decode fills page 3: no extra key
    pages = [PROMPT[0:4], PROMPT[4:8], PROMPT[8:12], [PROMPT[12], 7, 7, 7]]
    parent, keys = namespace_seed(None), []
    for tokens, page_keys in zip(pages, [(), (b"image-a",), (b"image-a", b"caption"), ()], strict=True):
        parent = xxh3_64_intdigest(identity(tokens, *page_keys), parent)
        keys.append(parent)
    encoded = [
        None,
        identity([], b"image-a"),
        identity([], b"image-a", b"caption"),
        None,
    ]
    assert cache.drain_events() == [
        BlockStored(keys[:3], None, PROMPT[:12], 4, None, encoded[:3]),
        BlockStored([keys[3]], keys[2], pages[3], 4, None, None),
    ]
    cache.close(seq)
    cache.check_invariants()


def test_int_and_str_keys() -> None:
    cache = PrefixCache(num_pages=32, page_size=2)
    admit_all(cache, [1, 2, 3, 4, 5], [(0, 2, 7)])
    admit_all(cache, [1, 2, 3, 4, 5], [(2, 4, "x")])
    assert cache.match([1, 2, 3, 4, 5], extra_keys=[(0, 2, 7)]) == 4
    assert cache.match([1, 2, 3, 4, 5], extra_keys=[(0, 2, 8)]) == 0
    assert cache.match([1, 2, 3, 4, 5], extra_keys=[(2, 4, "x")]) == 4
    assert cache.match([1, 2, 3, 4, 5], extra_keys=[(2, 4, "y")]) == 2
    events = cache.drain_events()
    assert events[0].extra_keys == [identity([], (7).to_bytes(8, "little")), None]


def test_resynchronisation_after_an_overflow_keeps_the_extra_keys() -> None:
    cache = PrefixCache(num_pages=64, page_size=4, max_events=1)
    admit_all(cache, PROMPT, IMAGE_A)
    admit_all(cache, [9] * 9)
    events = cache.drain_events()
    assert isinstance(events[0], AllBlocksCleared)
    stored = {tuple(e.block_hashes): e for e in events[1:]}
    with_image = next(e for e in stored.values() if e.token_ids[:4] == PROMPT[:4])
    assert with_image.extra_keys == [None, identity([], b"image-a"), identity([], b"image-a")]


@pytest.mark.parametrize(
    "extra_keys, error",
    [
        ("image", TypeError),
        ([(0, 2)], TypeError),
        ([[0, 2, b"k"]], TypeError),
        ([(2, 2, b"k")], ValueError),
        ([(-1, 2, b"k")], ValueError),
        ([(0, 14, b"k")], ValueError),
        ([(0, 2.0, b"k")], ValueError),
        ([(0, 2, 1.5)], TypeError),
        ([(0, 2, -1)], TypeError),
        ([(0, 2, True)], TypeError),
    ],
)
def test_bad_extra_keys_are_refused_and_change_nothing(extra_keys, error) -> None:
    cache = PrefixCache(num_pages=32, page_size=4)
    admit_all(cache, PROMPT, IMAGE_A)
    before = snapshot(cache)
    for call in (cache.match, cache.open, cache.admit):
        with pytest.raises(error, match="extra_keys"):
            call(PROMPT, extra_keys=extra_keys)
    assert snapshot(cache) == before
