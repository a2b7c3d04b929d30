"""The bookkeeping (cache, planner, events) imports and runs without torch or triton installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_bookkeeping_runs_without_torch_and_triton() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any "import torch" now raises ImportError
        sys.modules["triton"] = None
        import numpy as np
        import prefix_cache
        from prefix_cache import CascadePlanner, PrefixCache
        from prefix_cache.cache.events import BlockStored

        cache = PrefixCache(num_pages=64, page_size=4)
        seqs = [cache.admit(np.arange(20, dtype=np.int32), extra_tokens=1) for _ in range(3)]
        for seq in seqs:
            cache.commit(seq, np.arange(seq.num_tokens, 20, dtype=np.int32))
        plan = CascadePlanner().plan(
            [seq.block_table for seq in seqs], [20] * 3, [1] * 3, 4
        )
        assert plan.levels
        assert any(isinstance(event, BlockStored) for event in cache.drain_events())
        for seq in seqs:
            cache.close(seq)
        cache.check_invariants()
        assert "torch" not in {name.split(".")[0] for name, mod in sys.modules.items() if mod}
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
