"""Attention backends over cascade plans, created by name.

Backends are imported when asked for, so that a missing optional dependency (triton, flashinfer) only
fails for the backend that needs it.
"""

from __future__ import annotations

import importlib

from prefix_cache.attention.base import AttentionBackend
from prefix_cache.attention.capacity import GraphCapacity

# name -> (module, class, the optional package it needs or None, how to get that package)
_BACKENDS: dict[str, tuple[str, str, str | None, str]] = {
    "auto": (
        "prefix_cache.attention.auto_backend",
        "AutoBackend",
        "triton",
        "pip install 'prefix-cache[triton]'",
    ),
    "torch": ("prefix_cache.attention.torch_backend", "TorchBackend", None, ""),
    "triton": (
        "prefix_cache.attention.triton_backend",
        "TritonBackend",
        "triton",
        "pip install 'prefix-cache[triton]'",
    ),
    "flashinfer": (
        "prefix_cache.attention.flashinfer_backend",
        "FlashInferBackend",
        "flashinfer",
        "install a flashinfer-python wheel that matches your torch and CUDA",
    ),
}

BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)


def create_backend(name: str, **kwargs: object) -> AttentionBackend:
    """A new backend of the given name ("auto", "torch", "triton" or "flashinfer"); ``kwargs`` go to
    its constructor. "auto" is the one for engines: our Triton kernels, and FlashInfer's where they
    are faster and installed (see ``prefix_cache.attention.auto_backend``). Raises ValueError for an
    unknown name and ImportError, saying what to install, when the backend's optional dependency is
    missing."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    module_name, class_name, dependency, how = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
        backend = getattr(module, class_name)(**kwargs)
    except ModuleNotFoundError as error:
        if dependency is None or (error.name or "").split(".")[0] != dependency:
            raise
        raise ImportError(
            f"the {name!r} attention backend needs the {dependency!r} package: {how}"
        ) from error
    return backend


__all__ = ["BACKEND_NAMES", "AttentionBackend", "GraphCapacity", "create_backend"]
