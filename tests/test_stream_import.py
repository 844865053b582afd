"""The streaming import (issue 53): checkpoints read by row ranges, tables quantized chunk by
chunk with TorchRec's arithmetic, written straight to the version's tables folder, within
``--max-memory-bytes``.

* the readers give ``dcp.load``'s / ``torch.load``'s bytes: plain tensors, half tables,
  row and column shards (a sharded tensor saved by a gloo process group), and the real
  2-rank DMP checkpoint of the built-in DLRM (column-wise tables; slow);
* the streamed table bytes are ``torch.equal`` to the whole-model path
  (``quantize_inference_model`` + ``tables_from_quantized``) for every dtype, for the
  examples and the built-in DLRM;
* a refused import (a truncated shard, a check that fails) leaves the store unchanged;
* the import's peak RSS stays within its budget above the process's baseline.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from serve.errors import ArtifactError, CheckpointError
from serve.model.ckpt_stream import DcpSource, StateDictSource, open_source
from serve.model.importer import ImportConfig, import_model, load_factory
from serve.model.stream_import import Progress
from serve.store.repository import ModelRepository
from serve.store.tablefiles import TableFiles

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "fixtures" / "own_models.py"


def _perturbed(fn_spec: str, **kw: object) -> torch.nn.Module:
    fn, _ = load_factory(fn_spec)
    model = fn(**kw)
    with torch.no_grad():   # distinct rows everywhere (TorchRec inits are small)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model


def _dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


# ----------------------------------------------------------------------------- readers
def test_dcp_and_state_dict_readers_give_the_saved_bytes(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"_dmp_wrapped_module.t.weight": torch.randn(1000, 12, generator=g),
             "h.weight": torch.randn(40, 8, generator=g).half(),
             "bias": torch.randn(7, generator=g), "scalar": torch.tensor(2.5)}
    _dcp_save(state, tmp_path / "dcp")
    torch.save(state, tmp_path / "sd.pt")
    for src in (open_source(tmp_path / "dcp"), open_source(tmp_path / "sd.pt")):
        assert src.shapes() == {"t.weight": (1000, 12), "h.weight": (40, 8), "bias": (7,),
                                "scalar": ()}
        for k, v in state.items():
            assert torch.equal(src.read(k.removeprefix("_dmp_wrapped_module.")), v)
        t = state["_dmp_wrapped_module.t.weight"]
        for lo, hi in ((0, 1), (3, 517), (999, 1000), (10, 10)):
            assert torch.equal(src.read_rows("t.weight", lo, hi), t[lo:hi])
    assert isinstance(open_source(tmp_path / "dcp"), DcpSource)
    assert isinstance(open_source(tmp_path / "sd.pt"), StateDictSource)


def _sharded_dcp(path: Path, full: torch.Tensor, row_cut: int, col_cut: int) -> None:
    """``full`` saved as a ShardedTensor of 4 pieces (2 row x 2 column shards) by a
    one-rank gloo group, as a DMP's row/column-wise tables are saved."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    from serve.common.net import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows, cols = full.shape
        pieces = []
        for r0, nr in ((0, row_cut), (row_cut, rows - row_cut)):
            for c0, nc in ((0, col_cut), (col_cut, cols - col_cut)):
                pieces.append(Shard(full[r0 : r0 + nr, c0 : c0 + nc].clone(),
                                    ShardMetadata([r0, c0], [nr, nc], "rank:0/cpu")))
        st = init_from_local_shards(pieces, [rows, cols])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"ebc.t.weight": st}, checkpoint_id=str(path))
    finally:
        dist.destroy_process_group()


def test_row_and_column_shards_are_assembled(tmp_path: Path) -> None:
    full = torch.randn(300, 20, generator=torch.Generator().manual_seed(1))
    _sharded_dcp(tmp_path / "ck", full, row_cut=123, col_cut=8)
    src = DcpSource(tmp_path / "ck")
    assert sorted((c.offsets, c.sizes) for c in src.chunks("ebc.t.weight")) == [
        ((0, 0), (123, 8)), ((0, 8), (123, 12)), ((123, 0), (177, 8)), ((123, 8), (177, 12))]
    assert torch.equal(src.read("ebc.t.weight"), full)
    for lo, hi in ((0, 123), (100, 200), (122, 124), (299, 300)):
        assert torch.equal(src.read_rows("ebc.t.weight", lo, hi), full[lo:hi])


def test_the_built_in_dlrms_two_rank_checkpoint_reads_as_dcp_load(tiny_build) -> None:
    """The real checkpoint: 2 gloo ranks of a DMP, column-wise and table-wise tables."""
    from serve.model.dlrm import build_dlrm
    from serve.model.merge import load_dcp_into
    from serve.profiles import get_profile

    model = build_dlrm(get_profile("tiny"), device="cpu")
    load_dcp_into(model, tiny_build.checkpoint)
    src = DcpSource(tiny_build.checkpoint)
    columns = 0
    for k, v in model.state_dict().items():
        assert torch.equal(src.read(k), v), k
        if k.endswith(".weight") and "embedding_bags" in k:
            columns += len({c.offsets[1] for c in src.chunks(k)}) > 1
            n = v.shape[0]
            assert torch.equal(src.read_rows(k, n // 3, n - 1), v[n // 3 : n - 1]), k
    assert columns > 0   # some tables really are column-sharded


def test_a_truncated_shard_is_named(tmp_path: Path) -> None:
    _dcp_save({"t.weight": torch.randn(500, 16)}, tmp_path / "ck")
    shard = tmp_path / "ck" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:4000])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing or shorter than"):
        DcpSource(tmp_path / "ck").read_rows("t.weight", 0, 10)


def test_progress_prints_at_most_once_a_second() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress(1000, out, clock=lambda: now[0])
    for _ in range(9):
        now[0] += 0.3
        p.add(100, "t")
    p.add(100, "t")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3   # at 1.2 s and 2.4 s, then the last rows
    assert lines[-1].startswith("[tables] 1,000/1,000 rows (100.0%) t,") and "ETA 0 s" in lines[-1]


# ----------------------------------------------------------------------------- exactness
def _whole_model_tables(model: torch.nn.Module, schema) -> list[torch.Tensor]:
    """Today's whole-model path: quantize_inference_model, then the TBEs' rows."""
    from serve.model.export import quantize_for_serving, tables_from_quantized

    return [t.data for t in tables_from_quantized(quantize_for_serving(model, schema), schema)]


def test_streamed_rows_equal_the_whole_model_path_for_every_dtype(tmp_path: Path) -> None:
    """Chunks of 7 rows (a 16 MiB budget would take every table whole)."""
    import serve.model.stream_import as si
    from serve.model.export import model_schema

    model = _perturbed(f"{FIXTURE}:make_ranker").eval()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    src = open_source(tmp_path / "sd.pt")
    keys = si.table_keys(model)
    for dtype in ("int8", "int4", "fp16", "fp32"):
        schema = model_schema(model, 8, dtype=dtype)
        files = si.stream_tables(src, schema, keys, model, tmp_path / f"{dtype}.tables",
                                 budget_bytes=7 * 600)
        want = _whole_model_tables(model, schema)
        for i, w in enumerate(want):
            assert torch.equal(torch.from_numpy(np.array(files.array(i))), w), (dtype, i)
        files.close()


EXAMPLES = [
    ("own_ranker", {}, "int8"),
    ("article_dcn", {"ARTICLE_DCN_USER_ROWS": "3000", "ARTICLE_DCN_ITEM_ROWS": "2000"}, "int4"),
    ("dlrm_v2", {"DLRMV2_MAX_ROWS": "500"}, "fp16"),
]


@pytest.mark.parametrize("name,env,dtype", EXAMPLES)
def test_examples_import_from_dcp_exactly_with_the_whole_model_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, env: dict, dtype: str) -> None:
    from serve.model.export import model_schema

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = f"{ROOT / 'examples' / name / 'model.py'}:make_model"
    model = _perturbed(spec).eval()
    _dcp_save(model.state_dict(), tmp_path / "ck")
    store = tmp_path / "store"
    # A small budget: several chunks per table.
    out = import_model(ImportConfig(factory=spec, checkpoint=tmp_path / "ck", version="v1",
                                    model_store=store, dtype=dtype, default_max_ids=3,
                                    max_memory_bytes=1 << 24), say=lambda m: None,
                       progress=io.StringIO())
    assert out["max_abs_diff"] <= 1e-6 and out["peak_rss_bytes"] > 0 and out["seconds"] > 0
    repo = ModelRepository([store])
    files = TableFiles.open(repo.tables("v1"))
    _, module = load_factory(spec)
    schema = model_schema(model, module.NUM_DENSE, dtype=dtype,
                          max_ids=getattr(module, "MAX_IDS", {}), default_max_ids=3)
    for i, w in enumerate(_whole_model_tables(model, schema)):
        assert torch.equal(torch.from_numpy(np.array(files.array(i))), w), i
    files.close()
    assert repo.report("v1")["check"]["rows"] == "all"
    assert [p.name for p in store.iterdir() if p.name.startswith(".")] == []
    # The served runtime of the imported version answers a ranking request in the context
    # form (the example's declared user side) bit for bit as the same request expanded.
    context = repo.report("v1")["context_features"]
    assert context == list(module.CONTEXT_FEATURES)
    _assert_context_form_exact(repo, "v1", set(context), tmp_path / "x")


def _assert_context_form_exact(repo: ModelRepository, version: str, context: set[str],
                               work: Path) -> None:
    from serve.api.config import HandlerConfig
    from serve.runtime.artifact import load_artifact
    from serve.runtime.engine import Runtime
    from serve.store.repository import extract_artifact
    from serve.worker.arms import handle_batch
    from tests.test_importer import _context_pair

    work.mkdir()
    art = load_artifact(extract_artifact(repo.archive(version), work))
    rt = Runtime.from_artifact(art)

    def fwd(m):
        return rt.predict_arrays(m.dense, m.values, m.lengths, m.shared, m.bag_of)

    pairs = [_context_pair(art.schema, context, n, seed) for n, seed in ((23, 1), (1, 2))]
    assert len(pairs[0][0]) < len(pairs[0][1])  # the context really is sent once
    cfg = HandlerConfig()
    got, _ = handle_batch([c for c, _ in pairs], [None] * 2, fwd, cfg, schema=art.schema)
    want, _ = handle_batch([i for _, i in pairs], [None] * 2, fwd, cfg, schema=art.schema)
    assert [o.status for o in got] == [200, 200], [o.body[:200] for o in got]
    assert [o.body for o in got] == [o.body for o in want]
    rt.close()


def test_builtin_dlrm_checks_over_the_checked_rows_when_tables_pass_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables above a quarter of the budget: our runtime checks the rows the batch reads,
    read back from the written files (ids remapped), still exact; chunks of a few rows."""
    import serve.model.importer as imp

    monkeypatch.setattr(imp, "MIN_MAX_MEMORY_BYTES", 1)   # a budget below the tables
    spec = f"{FIXTURE}:make_builtin_tiny"
    model = _perturbed(spec)
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    out = import_model(ImportConfig(factory=spec, checkpoint=tmp_path / "sd.pt",
                                    version="tiny-x", model_store=tmp_path / "store",
                                    num_dense=13, default_max_ids=3, max_memory_bytes=20_000),
                       say=lambda m: None, progress=io.StringIO())
    assert out["max_abs_diff"] <= 1e-6
    report = ModelRepository([tmp_path / "store"]).report("tiny-x")
    assert report["dense_kind"] == "dlrm" and report["check"]["rows"] == "checked"
    assert report["table_bytes_quantized"] > 20_000 // 4


# ----------------------------------------------------------------------------- refusals
def _store_state(store: Path) -> list[str]:
    return sorted(os.listdir(store)) if store.exists() else []


def test_refused_imports_leave_the_store_unchanged(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import serve.model.stream_import as si

    spec = f"{FIXTURE}:make_ranker"
    model = _perturbed(spec)
    _dcp_save(model.state_dict(), tmp_path / "ck")
    store = tmp_path / "store"
    import_model(ImportConfig(factory=spec, checkpoint=tmp_path / "ck", version="good",
                              model_store=store), say=lambda m: None, progress=io.StringIO())
    before = _store_state(store)
    assert before == ["dlrm-good.json", "dlrm-good.mar", "dlrm-good.mar.sha256", "dlrm-good.tables"]

    # a check that fails: one table's codes quantized wrong
    real = si.quantize_chunk

    def off(rows: torch.Tensor, dtype: str) -> torch.Tensor:
        q = real(rows, dtype)
        q[:, 5] ^= 1
        return q

    monkeypatch.setattr(si, "quantize_chunk", off)
    with pytest.raises(ArtifactError, match=r"differ from TorchRec's quantized forward by .* > "
                                            r"1e-06; nothing was written"):
        import_model(ImportConfig(factory=spec, checkpoint=tmp_path / "ck", version="bad",
                                  model_store=store), say=lambda m: None, progress=io.StringIO())
    monkeypatch.setattr(si, "quantize_chunk", real)
    assert _store_state(store) == before

    # a shard cut short after the metadata was written: refused while streaming
    shard = tmp_path / "ck" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size - 5000])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        import_model(ImportConfig(factory=spec, checkpoint=tmp_path / "ck", version="cut",
                                  model_store=store), say=lambda m: None, progress=io.StringIO())
    assert _store_state(store) == before


def test_the_budget_flag_is_validated_and_documented(capsys: pytest.CaptureFixture) -> None:
    from serve.errors import ConfigError
    from serve.model.importer import main

    with pytest.raises(ConfigError, match=r"--max-memory-bytes 1000 must be a whole number >= "
                                          r"16777216 \(16 MiB\)"):
        ImportConfig(factory="f.py:f", checkpoint=Path("c"), version="v", max_memory_bytes=1000)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--max-memory-bytes" in capsys.readouterr().out


# ----------------------------------------------------------------------------- memory
_RSS_FACTORY = '''
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

NUM_DENSE = 4
ROWS = {rows}


class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_big", embedding_dim=64, num_embeddings=ROWS,
                               feature_names=["big"]),
            EmbeddingBagConfig(name="t_small", embedding_dim=16, num_embeddings=1000,
                               feature_names=["small"])], device=torch.device("cpu"))
        self.top = torch.nn.Linear(NUM_DENSE + 64 + 16, 1)

    def forward(self, dense, kjt):
        return self.top(torch.cat([dense, self.ebc(kjt).values()], 1))


def make_model():
    return Big()
'''

_RSS_RUN = '''
import json, sys
from pathlib import Path
import torch, torchrec, fbgemm_gpu  # the libraries: part of the baseline
from serve.model.importer import ImportConfig, import_model, load_factory, peak_rss_bytes
from serve.model.export import export_dense  # noqa: F401
fn, _ = load_factory(sys.argv[1])
base = peak_rss_bytes()
out = import_model(ImportConfig(factory=sys.argv[1], checkpoint=Path(sys.argv[2]), version="big",
                                model_store=Path(sys.argv[3]), max_memory_bytes=int(sys.argv[4])),
                   say=lambda m: None, progress=sys.stderr)
print(json.dumps({"baseline": base, "peak": out["peak_rss_bytes"], "diff": out["max_abs_diff"]}))
'''


@pytest.mark.slow
def test_peak_rss_stays_within_the_budget_above_the_baseline(tmp_path: Path) -> None:
    """A 410 MB fp32 table, a 64 MiB budget: peak RSS <= baseline + budget + 96 MiB of
    slack (the exported dense program, the check's reference and runtime)."""
    rows = 1_600_000
    (tmp_path / "big.py").write_text(_RSS_FACTORY.format(rows=rows))
    g = torch.Generator().manual_seed(0)
    state = {"ebc.embedding_bags.t_big.weight": torch.rand((rows, 64), generator=g) - 0.5,
             "ebc.embedding_bags.t_small.weight": torch.rand((1000, 16), generator=g) - 0.5,
             "top.weight": torch.randn(1, 84, generator=g), "top.bias": torch.zeros(1)}
    _dcp_save(state, tmp_path / "ck")
    table_bytes = state["ebc.embedding_bags.t_big.weight"].nbytes
    del state
    budget = 64 << 20
    assert table_bytes > 6 * budget
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_RUN, f"{tmp_path / 'big.py'}:make_model",
         str(tmp_path / "ck"), str(tmp_path / "store"), str(budget)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["diff"] <= 1e-6
    print(f"\nbaseline {got['baseline'] / 2**20:.0f} MiB, peak {got['peak'] / 2**20:.0f} MiB, "
          f"tables {table_bytes / 2**20:.0f} MiB fp32, budget {budget / 2**20:.0f} MiB")
    assert got["peak"] <= got["baseline"] + budget + (96 << 20)
    assert "[tables]" in proc.stderr and "rows/s, ETA" in proc.stderr
