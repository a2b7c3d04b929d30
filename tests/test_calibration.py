"""The packaged cost model is what ``benchmarks/calibrate_planner.py`` fits from the committed
calibration run: its coefficients regenerate from the data, and its tile rule is the Triton
backend's current one (a change to the backend's rule without a recalibration fails here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ROOT / "prefix_cache" / "data" / "cost_model_h200.json"


def test_the_packaged_cost_model_refits_from_the_committed_calibration(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a GPU host runs it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "calibrate_planner.py"),
         str(ROOT / "benchmarks" / "results" / "calibration_h200.json"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    fitted, packaged = json.loads(out.read_text()), json.loads(PACKAGED.read_text())
    rule = ("group_size", "min_rows", "max_rows", "join_rows", "join_tile_tokens", "sms_per_kv_head")
    for key in (*rule, "fitted_on", "shape"):
        assert fitted[key] == packaged[key], key
    for key in ("base_us", "launch_us", "level_us", "kv_token_us", "pair_us", "worst_chosen_over_best"):
        assert fitted[key] == pytest.approx(packaged[key], rel=1e-9), key
