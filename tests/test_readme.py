"""Every ```python block of README.md and docs/*.md runs as a user runs it.

Each block runs in a process of its own (``python -c``) from the repository root, on the CPU, with the
user's environment less what this test suite adds to it: ``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` for the suite, and a block that needs it must say so itself. ```bash blocks
are not run. Blocks that load the SmolLM2 weights (they read and dequantize its GGUF file, the
slowest block by far) are marked ``slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
SLOW_MARKS = ("load_model(",)
TIMEOUT_S = 300


def python_blocks(page: Path) -> list[str]:
    """The bodies of the page's ```python blocks, in order."""
    return BLOCK.findall(page.read_text())


def _params() -> list:
    params = []
    for page in PAGES:
        for index, code in enumerate(python_blocks(page)):
            marks = [pytest.mark.slow] if any(mark in code for mark in SLOW_MARKS) else []
            params.append(pytest.param(code, id=f"{page.relative_to(ROOT)}:{index}", marks=marks))
    return params


def _user_environment() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU-only, on any machine
    env.pop("PYTHONPATH", None)  # as a user runs it: the checkout's root and the installed packages
    return env


def test_block_extraction_finds_every_block() -> None:
    """The pattern takes every block whole, and only python ones (a changed fence would skip blocks)."""
    page = "text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = 2\nc = 3\n```\n"
    assert BLOCK.findall(page) == ["a = 1\n", "b = 2\nc = 3\n"]
    assert len(python_blocks(ROOT / "README.md")) >= 3


def test_a_failing_block_fails() -> None:
    """The runner reports a block that raises (a runner that always passed would prove nothing)."""
    result = _run("raise SystemExit('the block failed')")
    assert result.returncode != 0 and "the block failed" in result.stderr


def test_blocks_do_not_inherit_the_suite_environment() -> None:
    """TRITON_INTERPRET, which the suite sets, does not reach a block, and no GPU is visible."""
    code = "import os, torch; print(os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available())"
    assert _run(code).stdout.split() == ["None", "False"]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_user_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize("code", _params())
def test_block_runs_as_written(code: str) -> None:
    result = _run(code)
    if result.returncode != 0:
        pytest.fail(f"the block failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}", pytrace=False)
