"""The package's shape: the checkout never shadows another distribution, and imports form no circle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` as ``python -c`` from the checkout's root, as a user's script there would."""
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_an_installed_kernels_package_wins_over_the_checkout_folder(tmp_path: Path) -> None:
    # Hugging Face's "kernels" (which transformers imports) stands in as a package on PYTHONPATH:
    # the checkout's root comes first on sys.path, so its kernels/ folder is found first.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    done = _python("import kernels; from kernels import CUDAProperties; print(CUDAProperties)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "installed"


def test_without_an_installed_kernels_the_folder_is_not_importable_as_kernels(tmp_path: Path) -> None:
    # -S: no site-packages, so nothing named "kernels" is installed; the import fails as it would
    # outside the checkout, and availability checks (try: import kernels) see no package.
    done = _python("import kernels", tmp_path, "-S")
    assert done.returncode != 0
    assert "ModuleNotFoundError: No module named 'kernels'" in done.stderr


def test_the_kernels_import_as_part_of_the_package() -> None:
    pytest.importorskip("triton")
    from prefix_cache.kernels import append_kv

    assert append_kv.__module__ == "prefix_cache.kernels.kv_append"


def _runtime_imports(path: Path) -> set[str]:
    """Modules of prefix_cache that ``path`` imports at run time (not under ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "prefix_cache"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "kernels":
        parts = ("prefix_cache", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_runtime_import_circle_between_modules() -> None:
    files = [*ROOT.glob("prefix_cache/**/*.py"), *ROOT.glob("kernels/*.py")]
    modules = {_module_name(path): path for path in files}
    graph = {
        name: {dep for dep in _runtime_imports(path) if dep in modules and dep != name}
        for name, path in modules.items()
    }
    # A package's __init__ re-exports its modules; a module importing its own package's __init__
    # (from prefix_cache.cache import events) reaches it through the package, not a circle.
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(name: str, stack: list[str]) -> bool:
        state[name] = 1
        for dep in graph[name]:
            if name.startswith(dep + ".") or dep.startswith(name + "."):
                continue  # a package and its own modules
            if state.get(dep) == 1:
                cycle.extend([*stack[stack.index(dep) :], dep])
                return True
            if dep not in state and visit(dep, [*stack, dep]):
                return True
        state[name] = 2
        return False

    for name in sorted(graph):
        if name not in state and visit(name, [name]):
            break
    assert not cycle, " -> ".join(cycle)


def test_each_subsystem_is_a_package() -> None:
    flat = sorted(p.name for p in (ROOT / "prefix_cache").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py"], flat


# Which subsystems each may import at run time (docs/layout.md): the bookkeeping halves stand alone,
# events build on the cache, compute builds on plans, the tools on top use what they drive.
ALLOWED = {
    "cache": {"cache"},
    "planner": {"planner"},
    "events": {"events", "cache"},
    "kernels": {"kernels", "planner", "attention"},  # attention.kv_layout: the pools' layouts
    "attention": {"attention", "kernels", "planner"},
    "offload": {"offload", "attention", "cache"},  # cache.errors: PinningError is a PrefixCacheError
    "replay": {"replay", "cache", "events", "planner"},
}


def _subsystem(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_subsystems_import_only_what_the_layout_allows() -> None:
    files = [*ROOT.glob("prefix_cache/**/*.py"), *ROOT.glob("kernels/*.py")]
    wrong = []
    for path in files:
        name = _module_name(path)
        mine = _subsystem(name)
        if mine is None:
            continue
        for dep in _runtime_imports(path):
            theirs = _subsystem(dep)
            if dep != "prefix_cache" and (theirs is None or theirs not in ALLOWED[mine]):
                wrong.append(f"{name} imports {dep}")
    assert not wrong, wrong
