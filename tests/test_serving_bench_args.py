"""The serving benchmark's host tier arms: which (host pages, copy policy) runs a command line asks for."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
sys.path.insert(0, BENCHMARKS)
try:
    from bench_serving import host_arms, host_modes
finally:
    sys.path.remove(BENCHMARKS)


def test_each_tier_size_runs_once_per_mode_and_no_tier_once() -> None:
    assert host_arms([0, 8192], ["back", "through"]) == [(0, "back"), (8192, "back"), (8192, "through")]
    assert host_arms([8192, 0], ["through"]) == [(8192, "through"), (0, "through")]
    assert host_arms([0], ["back", "through"]) == [(0, "back")]


@pytest.mark.parametrize("text", ["back,back", "through,sideways", ""])
def test_modes_are_back_and_through_each_once(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="host modes are back and through, each once"):
        host_modes(text)
    assert host_modes("through,back") == ["through", "back"]
