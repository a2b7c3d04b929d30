"""Shared by the engine and server tests: SmolLM2 and its Hugging Face reference, loaded once per session."""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.engine import LlamaModel  # noqa: E402
from examples.engine.chat import ChatML  # noqa: E402

#: Two logits closer than this (fp32, logits of magnitude ~40) are a tie: rounding may pick either.
TIE_TOLERANCE = 1e-3


@pytest.fixture
def one_torch_thread():
    """Torch on one thread while the test runs: CI machines have 2 cores, and two spinning intra-op
    threads next to other processes make a step of this small model up to 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def smollm2() -> tuple[LlamaModel, ChatML]:
    """The engine's SmolLM2 (float32, CPU) and chat format; skips when the GGUF file is missing."""
    pytest.importorskip("gguf")
    from examples.engine.gguf_file import find_gguf
    from examples.engine.loading import load_model

    try:
        find_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_model("smollm2")


@functools.cache
def hf_reference(num_layers: int | None = None) -> object:
    """transformers' LlamaForCausalLM read from the same GGUF file by transformers' own loader, in
    float32; with ``num_layers``, only its first layers (the same weights)."""
    transformers = pytest.importorskip("transformers")
    from examples.engine.gguf_file import find_gguf

    path = find_gguf()
    if num_layers is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        return model.eval()
    model = copy.copy(hf_reference())
    model.model = copy.copy(model.model)
    model.model.layers = model.model.layers[:num_layers]
    model.config = copy.deepcopy(model.config)
    model.config.num_hidden_layers = num_layers
    return model


def truncated(model: LlamaModel, num_layers: int) -> LlamaModel:
    """``model`` with only its first ``num_layers`` layers (weights shared)."""
    config = dataclasses.replace(model.config, num_layers=num_layers)
    return LlamaModel(config, model.layers[:num_layers], model.embed, model.final_norm, model.lm_head)


@functools.cache
def _hf_greedy(num_layers: int | None, prompt: bytes, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    hf = hf_reference(num_layers)
    ids = torch.from_numpy(np.frombuffer(prompt, dtype=np.int32).astype(np.int64))[None]
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    tokens = out.sequences[0, ids.shape[1] :].numpy()
    return tokens, torch.stack(out.logits)[:, 0].numpy()


def assert_matches_hf(prompt: np.ndarray, output: np.ndarray, num_layers: int | None = None) -> None:
    """``output`` (greedy, ``len(output)`` tokens) is what HF ``generate`` gives for ``prompt``; at
    the first difference, if any, HF's logits must show a tie (within TIE_TOLERANCE) between the two
    tokens, and the rest is not compared (the continuations differ from there)."""
    expected, logits = _hf_greedy(num_layers, prompt.astype(np.int32).tobytes(), len(output))
    diff = np.nonzero(expected != output)[0]
    if len(diff):
        j = int(diff[0])
        gap = abs(float(logits[j, expected[j]]) - float(logits[j, output[j]]))
        assert gap < TIE_TOLERANCE, (
            f"token {j}: engine {output[j]}, transformers {expected[j]} (logit gap {gap:.2e})\n"
            f"engine {output.tolist()}\nhf     {expected.tolist()}"
        )


def error_line(capsys: pytest.CaptureFixture[str], main, argv: list[str]) -> str:
    """The last line a command line printed when it refused ``argv``: exit status 2, no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]
