"""Shared test setup. Fixtures live in tests/fixtures/, one module per component."""
import pytest
import torch

pytest_plugins = [
    "tests.fixtures.pipeline",
    "tests.fixtures.torchserve",
    "tests.fixtures.sidecar",
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: starts real servers (TorchServe, sidecar)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
