"""Triton kernels for paged and cascade attention (installed as ``prefix_cache.kernels``).

- ``attention``: attention of one cascade level with natural-log LSE (``plan_level`` +
  ``launch_level``, or ``level_attention`` in one call);
- ``merge_state``: merging partial (out, lse) states (``merge_states``, ``merge_states_varlen``);
- ``kv_append``: writing new K/V into the paged cache (``append_kv``), quantizing into an fp8 one.

The folder sits at the top of the checkout, where ``python -m ...`` and scripts run from the
checkout find it as a top-level package ``kernels``: a name that belongs to an installed
distribution (Hugging Face's ``kernels``, which transformers imports). Imported under that name, this
module hands it over to the installed package, or raises ``ModuleNotFoundError`` as if the folder were
not there, so it never shadows anything.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
else:
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
