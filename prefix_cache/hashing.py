"""Block identity: chained 64-bit hashes of page tokens, seeded per namespace.

A full page's key is ``hash_fn(page_token_bytes, parent_key)``, where ``page_token_bytes`` is the
page's ``page_size`` tokens as little-endian int32 (``4 * page_size`` bytes) and ``parent_key`` is
the key of the page before it, or the namespace seed for the first page. Equal keys therefore mean
"probably the same tokens after the same preceding tokens in the same namespace"; the block tree
still compares the stored tokens before it reuses a page, so a collision costs a cache miss, never
wrong KV.
"""

from __future__ import annotations

from collections.abc import Callable

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
