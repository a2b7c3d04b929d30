"""Fixed sizes of a backend whose ``run`` is replayed in CUDA graphs (no torch, no triton: an engine
sizes its graphs with it before it knows whether the Triton backend is installed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphCapacity:
    """Fixed sizes of a backend whose ``run`` is captured in a CUDA graph and replayed across plans.

    max_query_tokens: query tokens of the largest batch (the rows of the q a graph is captured with;
        a smaller batch is padded by the engine, its extra output rows are left as they were; the auto
        backend's FlashInfer prefill launches may overwrite them in a contiguous ``out``: zeros on Hopper).
    max_pages: page ids over all levels of a plan (the sum of ``len(level.kv_indices)``).
    max_levels: levels of a plan (``CascadePlanner.max_levels``).
    max_work_items: work items per launch; default ``max_query_tokens * max_levels`` plus room
        for 2048 split items.
    max_partial_rows: partial (out, lse) float32 rows of ``num_qo_heads * head_dim``; default
        ``max_query_tokens * max_levels`` plus room for 4096 split rows (64 MiB at 32 x 128).
    A plan whose splits do not fit takes fewer, longer splits.
    """

    max_query_tokens: int
    max_pages: int
    max_levels: int = 4
    max_work_items: int | None = None
    max_partial_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_query_tokens", "max_pages", "max_levels", "max_work_items"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"GraphCapacity.{name} must be >= 1, got {value}")
        if self.max_partial_rows is not None and self.max_partial_rows < 0:
            raise ValueError(f"GraphCapacity.max_partial_rows must be >= 0, got {self.max_partial_rows}")

    @property
    def work_items(self) -> int:
        if self.max_work_items is not None:
            return self.max_work_items
        return self.max_query_tokens * self.max_levels + 2048

    @property
    def partial_rows(self) -> int:
        if self.max_partial_rows is not None:
            return self.max_partial_rows
        return self.max_query_tokens * self.max_levels + 4096
