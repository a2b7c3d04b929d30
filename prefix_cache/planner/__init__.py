"""The cascade planner: a batch's page tables into shared-prefix levels and a unique level.

``CascadePlanner`` finds the sharing tree of a batch and, with its calibrated cost model, decides
which shared prefixes get a level of their own; ``CascadePlan`` / ``CascadeLevel`` hold the result in
FlashInfer's multi-level layout. Plain numpy: no torch.
"""

from prefix_cache.planner.plan import CascadeLevel, CascadePlan
from prefix_cache.planner.planner import CascadePlanner

__all__ = ["CascadeLevel", "CascadePlan", "CascadePlanner"]
