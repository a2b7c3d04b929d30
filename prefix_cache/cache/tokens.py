"""Validation of token input: any 1-D sequence of token ids becomes an int32 numpy array."""

from __future__ import annotations

import sys

import numpy as np

#: Token ids are stored as int32, so they must lie in ``[0, MAX_TOKEN_ID]``.
MAX_TOKEN_ID = 2**31 - 1

_INT32 = np.dtype(np.int32)
# Index of the byte holding an int32's sign bit, in native byte order.
_SIGN_BYTE = 3 if sys.byteorder == "little" else 0
# Up to this many tokens, testing the sign bytes beats a numpy reduction (a couple of µs per call).
_SIGN_BYTES_MAX = 2048
_BOOL_TYPES = frozenset((bool, np.bool_))


def as_token_array(tokens: object) -> np.ndarray:
    """Return ``tokens`` as a 1-D int32 numpy array, a view of the input where possible.

    Accepts a list or tuple of ints, a numpy integer array or a CPU torch integer tensor.
    Raises TypeError for non-integer values (floats, bools, strings) and ValueError for a shape
    other than 1-D, a tensor on another device, or ids outside ``[0, 2**31)``.
    """
    arr = tokens if type(tokens) is np.ndarray else _to_numpy(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype is _INT32 or arr.dtype == _INT32:
        if _has_negative(arr):
            raise ValueError(f"token ids must be >= 0, got {int(arr.min())}")
        return arr
    kind = arr.dtype.kind
    if kind == "b":
        raise TypeError("token ids must be integers, got booleans")
    if kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, 2**31), got range [{arr.min()}, {arr.max()}]")
    return arr.astype(_INT32)


def _has_negative(arr: np.ndarray) -> bool:
    """Whether the 1-D int32 ``arr`` holds a value below 0."""
    if len(arr) <= _SIGN_BYTES_MAX:
        # A negative int32 is one whose sign byte is >= 0x80, i.e. not ASCII.
        return not arr.tobytes()[_SIGN_BYTE::4].isascii()
    return bool(arr.min() < 0)


def _to_numpy(tokens: object) -> np.ndarray:
    """Any accepted non-ndarray input as a numpy array, not yet checked for shape or range."""
    # A tensor can only exist once torch is imported, so there is no need to import it here.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tokens, torch.Tensor):
        if tokens.device.type != "cpu":
            raise ValueError(f"tokens must be a CPU tensor, got one on {tokens.device}")
        if tokens.dtype == torch.bool:
            raise TypeError("token ids must be integers, got a bool tensor")
        if tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"token ids must be integers, got a {tokens.dtype} tensor")
        return tokens.detach().numpy()
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not hasattr(tokens, "__len__"):
        raise TypeError(f"tokens must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if len(tokens) == 0:
        return np.empty(0, dtype=_INT32)
    try:
        arr = np.asarray(tokens)
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"tokens must be a flat sequence of ints: {exc}") from None
    if arr.dtype.kind == "O" and arr.ndim == 1 and all(type(t) is int for t in tokens):
        # Python ints too large for any numpy integer type.
        raise ValueError("token ids must lie in [0, 2**31)")
    if arr.dtype.kind in "iu" and not _BOOL_TYPES.isdisjoint(map(type, tokens)):
        # numpy turns [1, True] into int64 silently; a bool is not a token id.
        raise TypeError("token ids must be integers, got a bool")
    return arr
