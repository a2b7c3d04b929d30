"""The cache benchmark's command line: bad arguments fail in one line, and a plain run does not
overwrite the committed results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_cache.py"


@pytest.mark.parametrize(
    "args", [["--repeats", "0"], ["--repeats", "-2"], ["--conversations", "x"], ["--num-pages", "0"]]
)
def test_bad_arguments_fail_in_one_line(args) -> None:
    run = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert f"argument {args[0]}: must be an integer >= 1" in run.stderr


def test_default_output_is_not_the_committed_results_file() -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench_cache
    finally:
        sys.path.remove(str(BENCH.parent))
    committed = ROOT / "benchmarks" / "results" / "cache_sharegpt.md"
    assert committed != bench_cache.RESULTS
    tracked = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "-q", str(bench_cache.RESULTS)], capture_output=True
    )
    assert tracked.returncode == 0  # git-ignored
