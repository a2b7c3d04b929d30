"""Triton kernels for paged and cascade attention (installed as ``prefix_cache.kernels``)."""
