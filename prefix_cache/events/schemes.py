"""Block hash schemes a router recomputes from prompts: this library's, and vLLM's.

A :class:`BlockIndex` registers each replica with the scheme its engine hashes blocks with, and
computes a prompt's keys once per scheme in use.

- :class:`PrefixCacheHash`: ``PrefixCache``'s default, chained xxh3-64 seeded per namespace
  (:mod:`prefix_cache.cache.hashing`).
- :class:`VllmHash`: vLLM's ``hash_block_tokens`` with ``--prefix-caching-hash-algo`` ``sha256``
  (the default; SHA-256 of the pickle of a Python tuple) or ``sha256_cbor`` (SHA-256 of canonical
  CBOR, what routers outside Python recompute). Block ``i``'s hash is ``H((parent, tokens_i,
  extra_keys_i))`` with ``parent`` the previous block's hash (32 bytes), or for the first block
  ``NONE_HASH = H(seed)``, ``seed`` the string ``PYTHONHASHSEED`` of the engine when set, else
  ``"vllm-none-hash"``. ``tokens_i`` is the tuple of the block's token ids and ``extra_keys_i``
  None, or for a request with a ``cache_salt`` the tuple ``(("cache_salt", salt),)`` on the
  first block. The hash on the wire is the int of its last 8 bytes, big-endian.

Keys are ints in ``[0, 2**64)`` in both schemes.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from prefix_cache.cache.hashing import ExtraKey, Namespace, default_hash_fn, namespace_seed, page_extras

_LE_INT32 = np.dtype("<i4")
#: The seed vLLM derives ``NONE_HASH`` from for its SHA-256 algorithms when ``PYTHONHASHSEED`` is unset.
VLLM_DEFAULT_SEED = "vllm-none-hash"
#: The pickle protocol of vLLM's ``sha256`` (``pickle.HIGHEST_PROTOCOL`` on the Pythons vLLM supports).
PICKLE_PROTOCOL = 5


@dataclass(frozen=True)
class PrefixCacheHash:
    """``PrefixCache``'s default block hash (a custom ``hash_fn`` cannot be followed)."""

    def keys(
        self,
        tokens: np.ndarray,
        page_size: int,
        namespace: Namespace,
        extra_keys: list[ExtraKey] | None,
        num_pages: int,
    ) -> Iterator[int]:
        """The keys of the first ``num_pages`` full pages of ``tokens`` (int32), lazily (a lookup
        stops at its first miss)."""
        extras = page_extras(extra_keys, len(tokens), page_size)
        data = tokens[: num_pages * page_size].astype(_LE_INT32, copy=False).tobytes()
        step = 4 * page_size
        key = namespace_seed(namespace)
        for page in range(num_pages):
            identity = data[page * step : (page + 1) * step]
            if page in extras:
                identity += extras[page]
            key = default_hash_fn(identity, key)
            yield key


@dataclass(frozen=True)
class VllmHash:
    """A vLLM engine's block hash (see the module docstring).

    Arguments:
        algo: the engine's ``--prefix-caching-hash-algo``, ``"sha256"`` or ``"sha256_cbor"``
            (``xxhash`` and ``xxhash_cbor`` seed from random bytes per process unless
            ``PYTHONHASHSEED`` is set, and are not supported here).
        seed: the engine's ``PYTHONHASHSEED`` (a string), None when it is unset.

    A namespace is the request's ``cache_salt`` (a str; None for none); prompts with
    ``extra_keys`` (multimodal inputs, LoRA) have keys vLLM derives from its own processor and
    adapter state, so :meth:`keys` yields none for them.
    """

    algo: Literal["sha256", "sha256_cbor"] = "sha256"
    seed: str | None = None

    def __post_init__(self) -> None:
        if self.algo not in ("sha256", "sha256_cbor"):
            raise ValueError(f"algo must be 'sha256' or 'sha256_cbor', got {self.algo!r}")
        if self.seed is not None and not isinstance(self.seed, str):
            raise TypeError(f"seed must be a str (PYTHONHASHSEED) or None, got {type(self.seed).__name__}")

    def digest(self, value: object) -> bytes:
        """``H(value)``: 32 bytes."""
        if self.algo == "sha256":
            return hashlib.sha256(pickle.dumps(value, protocol=PICKLE_PROTOCOL)).digest()
        return hashlib.sha256(cbor(value)).digest()

    @cached_property
    def none_hash(self) -> bytes:
        """The parent of a prompt's first block (32 bytes)."""
        return self.digest(VLLM_DEFAULT_SEED if self.seed is None else self.seed)

    def keys(
        self,
        tokens: np.ndarray,
        page_size: int,
        namespace: Namespace,
        extra_keys: list[ExtraKey] | None,
        num_pages: int,
    ) -> Iterator[int]:
        """The published keys (ints) of the first ``num_pages`` full pages of ``tokens``, lazily."""
        if extra_keys or (namespace is not None and not isinstance(namespace, str)):
            return
        parent = self.none_hash
        values = tokens[: num_pages * page_size].tolist()
        for page in range(num_pages):
            extras = (("cache_salt", namespace),) if page == 0 and namespace else None
            block = tuple(values[page * page_size : (page + 1) * page_size])
            parent = self.digest((parent, block, extras))
            yield int.from_bytes(parent[-8:], "big")


HashScheme = PrefixCacheHash | VllmHash


def cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of None, bools, ints in
    ``(-2**64, 2**64)``, bytes, str, and tuples / lists of those; TypeError for anything else."""
    out = bytearray()
    _cbor(value, out)
    return bytes(out)


def _head(major: int, n: int, out: bytearray) -> None:
    if n < 24:
        out.append(major << 5 | n)
    elif n < 1 << 8:
        out += bytes((major << 5 | 24, n))
    elif n < 1 << 16:
        out.append(major << 5 | 25)
        out += n.to_bytes(2, "big")
    elif n < 1 << 32:
        out.append(major << 5 | 26)
        out += n.to_bytes(4, "big")
    else:
        out.append(major << 5 | 27)
        out += n.to_bytes(8, "big")


def _cbor(value: object, out: bytearray) -> None:
    kind = type(value)
    if value is None:
        out.append(0xF6)
    elif kind is bool:
        out.append(0xF5 if value else 0xF4)
    elif kind is int:
        if not -(1 << 64) <= value < 1 << 64:
            raise TypeError(f"cbor: int out of 64-bit range: {value}")
        if value >= 0:
            _head(0, value, out)
        else:
            _head(1, -1 - value, out)
    elif kind is bytes:
        _head(2, len(value), out)
        out += value
    elif kind is str:
        raw = value.encode("utf-8")
        _head(3, len(raw), out)
        out += raw
    elif kind is tuple or kind is list:
        _head(4, len(value), out)
        for item in value:
            _cbor(item, out)
    else:
        raise TypeError(f"cbor: cannot encode {kind.__name__}")
