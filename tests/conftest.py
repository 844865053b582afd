"""Shared test setup. Fixtures live in tests/fixtures/, one module per component."""
import os

import pytest
import torch

pytest_plugins = [
    "tests.fixtures.pipeline",
    "tests.fixtures.torchserve",
    "tests.fixtures.sidecar",
]


def pytest_configure(config: pytest.Config) -> None:
    # The sidecars the tests start (subprocesses inherit this) run without the batching
    # tuner, which would otherwise retune under a test's load and change the serving
    # version behind its back; tests/test_tuner_e2e.py turns it on for itself.
    os.environ.setdefault("DLRM_AUTOTUNE", "0")


# Fixtures that run the real 2-rank training pipeline (about 15 s on 2 cores, cached in
# build/test-cache afterwards): every test that uses one, directly or through another
# fixture, is `slow`, so `make test-fast` never trains.
TRAINING_FIXTURES = frozenset({"tiny_build", "tiny_build_seed7", "tiny_build_shuffled"})


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        if TRAINING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
