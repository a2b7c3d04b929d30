"""Block identity: chained 64-bit hashes of page tokens, seeded per namespace.

A full page's key is ``hash_fn(page_token_bytes, parent_key)``, where ``page_token_bytes`` is the
page's ``page_size`` tokens as little-endian int32 (``4 * page_size`` bytes) and ``parent_key`` is
the key of the page before it, or the namespace seed for the first page. Equal keys therefore mean
"probably the same tokens after the same preceding tokens in the same namespace"; the block tree
still compares the stored tokens before it reuses a page, so a collision costs a cache miss, never
wrong KV.

Extra keys (an image's content hash over its placeholder tokens, say) are part of a page's
identity: ``page_token_bytes`` is then followed by, for each extra key whose token range overlaps
the page, in the order given, the key's length as a 4-byte little-endian unsigned int and the
key's bytes (a str is UTF-8 encoded, an int in ``[0, 2**64)`` is 8 little-endian bytes). The block
key is the hash of those identity bytes, so a router recomputes it as
``xxh3_64(page_tokens_int32_le + extras, seed=parent_key)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from xxhash import xxh3_64_intdigest

#: What separates tenants, LoRA adapters or cache salts: pages never match across namespaces.
Namespace = str | bytes | int | None

#: ``hash_fn(page_token_bytes, parent_key) -> key``. Keys and the parent key are ints in
#: ``[0, 2**64)``. The argument order matches ``xxhash.xxh3_64_intdigest(data, seed)`` so the default
#: needs no wrapper on the hot path.
HashFn = Callable[[bytes, int], int]

#: The default block hash: 64-bit xxh3 of the page bytes, seeded with the parent's key.
default_hash_fn: HashFn = xxh3_64_intdigest

_NAMESPACE_TAGS: dict[type, bytes] = {str: b"s", bytes: b"b", int: b"i"}


def check_namespace(namespace: object) -> None:
    """Raise TypeError unless ``namespace`` is None, a str, bytes or an int (bools are refused:
    ``True == 1`` would silently share a namespace with ``1``)."""
    if namespace is not None and type(namespace) not in _NAMESPACE_TAGS:
        raise TypeError(f"namespace must be None, str, bytes or int, got {type(namespace).__name__}")


def namespace_seed(namespace: Namespace) -> int:
    """The parent key of a namespace's first page: an int in ``[0, 2**64)``.

    The value's type is part of the seed, so ``"1"``, ``b"1"`` and ``1`` are different namespaces.
    """
    check_namespace(namespace)
    if namespace is None:
        return xxh3_64_intdigest(b"prefix-cache:none")
    if isinstance(namespace, str):
        payload = namespace.encode("utf-8", "surrogatepass")
    elif isinstance(namespace, bytes):
        payload = namespace
    else:
        payload = str(namespace).encode("ascii")
    return xxh3_64_intdigest(b"prefix-cache:" + _NAMESPACE_TAGS[type(namespace)] + b":" + payload)


#: An extra key over a token range: ``(start, end, key)``, tokens ``start <= t < end``.
ExtraKey = tuple[int, int, "bytes | str | int"]


def page_extras(extra_keys: Iterable[ExtraKey] | None, num_tokens: int, page_size: int) -> dict[int, bytes]:
    """The extra identity bytes of each page that an extra key overlaps (see the module
    docstring), by page index. Raises TypeError / ValueError naming ``extra_keys`` for bad input."""
    if extra_keys is None:
        return {}
    if isinstance(extra_keys, (str, bytes)) or not isinstance(extra_keys, Iterable):
        raise TypeError(f"extra_keys must be a list of (start, end, key), got {type(extra_keys).__name__}")
    extras: dict[int, bytes] = {}
    for item in extra_keys:
        if not isinstance(item, tuple) or len(item) != 3:
            raise TypeError(f"extra_keys entries must be (start, end, key) tuples, got {item!r}")
        start, end, key = item
        if type(start) is not int or type(end) is not int or not 0 <= start < end <= num_tokens:
            raise ValueError(
                f"extra_keys range ({start!r}, {end!r}) must be ints with 0 <= start < end <= {num_tokens}"
            )
        if type(key) is bytes:
            raw = key
        elif type(key) is str:
            raw = key.encode("utf-8", "surrogatepass")
        elif type(key) is int and 0 <= key < 2**64:
            raw = key.to_bytes(8, "little")
        else:
            raise TypeError(f"extra_keys key must be bytes, str or an int in [0, 2**64), got {key!r}")
        encoded = len(raw).to_bytes(4, "little") + raw
        for page in range(start // page_size, (end - 1) // page_size + 1):
            extras[page] = extras.get(page, b"") + encoded
    return extras
