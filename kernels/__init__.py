"""Triton kernels for paged and cascade attention (installed as ``prefix_cache.kernels``).

- ``attention``: attention of one cascade level with natural-log LSE (``plan_level`` +
  ``launch_level``, or ``level_attention`` in one call);
- ``merge_state``: merging partial (out, lse) states (``merge_states``, ``merge_states_varlen``);
- ``kv_append``: writing new K/V into the paged cache (``append_kv``).
"""

from prefix_cache.kernels.attention import LevelSchedule, launch_level, level_attention, plan_level
from prefix_cache.kernels.kv_append import append_kv
from prefix_cache.kernels.merge_state import merge_states, merge_states_varlen

__all__ = [
    "LevelSchedule",
    "append_kv",
    "launch_level",
    "level_attention",
    "merge_states",
    "merge_states_varlen",
    "plan_level",
]
