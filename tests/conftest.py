import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when a kernel is
# defined, so it is set before any test module imports prefix_cache.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        help="also run the tests marked slow (tens of seconds or more each on a 2-core CPU); CI runs them",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
