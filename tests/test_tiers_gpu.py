"""The device tier over disk-backed rows on CUDA (``make gpu-check``): exact against the
all-in-device runtime. Imports only torch, numpy and serve's runtime and store (the GPU
machine has no prometheus_client, TorchRec or FBGEMM); tests/test_tiers.py holds the CPU
tests and reuses the helpers here."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from serve.runtime.artifact import Artifact, tables_from_files
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.store.tablefiles import TableFiles, TableWriter
from tests.fixtures.own_models import random_artifact

HAS_CUDA = torch.cuda.is_available()
# Mixed dims and dtypes: three row widths (int8 dim 8: 12 B, fp16 dim 4: 8 B, int8 dim 16:
# 20 B), a table read by two features, sum and mean pooling.
TABLES = (("ta", 700, 8, "sum", "int8"), ("tb", 300, 4, "mean", "fp16"),
          ("tc", 500, 16, "sum", "int8"))
FEATURES = (("fa", "ta", 4), ("fb", "tb", 4), ("fc", "tc", 4), ("fa2", "ta", 4))
ONE_WIDTH = (("ua", 900, 8, "sum", "int8"), ("ub", 400, 8, "sum", "int8"))
ONE_WIDTH_FEATURES = (("ga", "ua", 4), ("gb", "ub", 4))


def on_disk(art: Artifact, folder: Path) -> Artifact:
    """``art`` with its tables written to ``folder`` (TableWriter) and mapped from there
    (``files`` set), as a format-3 load gives it."""
    with TableWriter(folder, art.schema.tables) as w:
        for i, t in enumerate(art.tables):
            w.write(i, 0, t.data)
        w.commit()
    files = TableFiles.open(folder)
    return dataclasses.replace(art, tables=tables_from_files(files), files=files)


def batches(art: Artifact, n: int, seed: int = 0, b: int = 48, alpha: float = 1.1,
            max_id: int = 2000) -> list[tuple[torch.Tensor, SparseBatch]]:
    """Zipf-skewed multi-hot batches (ids >= rows wrap)."""
    g = torch.Generator().manual_seed(seed)
    nf = len(art.schema.features)
    probs = 1.0 / torch.arange(1, max_id + 1).double() ** alpha
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (nf, b), generator=g, dtype=torch.int32)
        values = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)
        out.append((torch.randn(b, art.num_dense, generator=g), SparseBatch(values, lengths)))
    return out



def budget_settings(kind: float | None) -> dict:
    """RuntimeConfig's host budget: None no bound, 0 no slots, else a fraction."""
    if kind is None:
        return {}
    return {"host_cache_bytes": 0} if kind == 0 else {"host_cache_fraction": kind}


@pytest.fixture(scope="module")
def mixed() -> Artifact:
    return random_artifact(TABLES, FEATURES, seed=3)


@pytest.fixture(scope="module")
def one_width() -> Artifact:
    return random_artifact(ONE_WIDTH, ONE_WIDTH_FEATURES, seed=4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [0, 0.1, None])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("multi", [False, True], ids=["one-width", "mixed"])
def test_device_tier_over_disk_on_cuda(mixed, one_width, tmp_path, budget, policy, multi):
    src = mixed if multi else one_width
    ref = Runtime(src, RuntimeConfig(device="cuda", cache_load_factor=1.0))
    rt = Runtime(on_disk(src, tmp_path / "v.tables"),
                 RuntimeConfig(device="cuda", cache_policy=policy, cache_load_factor=0.05,
                               cuda_graphs=True, cache_miss_path="mapped",
                               **budget_settings(budget)))
    assert rt.cache is not None and not rt.store.static_ok(4)
    for dense, sparse in batches(src, 6, seed=11):
        assert torch.equal(rt.predict(dense, sparse), ref.predict(dense, sparse))
    dev = rt.stats().tiers["device"]
    assert dev.lookups > 0 and dev.read_bytes == dev.miss_rows * rt.row_bytes
    rt.close()
