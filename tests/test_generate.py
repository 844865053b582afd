"""The full-size path at CI size: examples/article_two_tables and serve.model.generate.

A generated DCP checkpoint must load with stock ``dcp.load`` into the model exactly as
generated (every key, chunks spread over several rank files) and import exactly; a
generated version must serve, with the rows an import of the same weights stores.
"""
from __future__ import annotations

import io
import json
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from serve.errors import ConfigError
from serve.model.generate import (
    BLOCK_ROWS,
    Progress,
    VersionConfig,
    main,
    quantize_rows,
    seeded_model,
    table_inits,
    table_rows_fp32,
    write_checkpoint,
    write_version,
)
from serve.model.importer import ImportConfig, generated_batch, import_model, load_factory
from serve.runtime.artifact import load_artifact
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = f"{ROOT / 'examples' / 'article_two_tables' / 'model.py'}:make_model"
DLRMV2 = f"{ROOT / 'examples' / 'dlrm_v2' / 'model.py'}:make_model"
CHUNK = 2 * BLOCK_ROWS


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both examples at a few chunks per table (the last chunk and block partial)."""
    monkeypatch.setenv("ARTICLE_SCALE", "small")
    monkeypatch.setenv("ARTICLE_USER_ROWS", "300000")   # 3 chunks of 131072
    monkeypatch.setenv("ARTICLE_ITEM_ROWS", "70000")    # 1 chunk, 2 blocks
    monkeypatch.setenv("DLRMV2_MAX_ROWS", "3000")


def _expected(factory: str, seed: int) -> dict[str, torch.Tensor]:
    """The generated state dict, whole: dense from the seeded factory, tables drawn."""
    model, _ = seeded_model(factory, seed)
    want = {k: v.clone() for k, v in model.state_dict().items() if not v.is_meta}
    for t in table_inits(model):
        want[t.fqn] = table_rows_fp32(t, seed, 0, t.rows)
    return want


def _dcp_load(ckpt: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    got = {k: torch.full_like(v, float("nan")) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, checkpoint_id=str(ckpt), no_dist=True)
    return got


# ----------------------------------------------------------------------------- the example
def test_article_two_tables_sizes_and_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    make_model, module = load_factory(ARTICLE)
    monkeypatch.delenv("ARTICLE_USER_ROWS", raising=False)
    monkeypatch.delenv("ARTICLE_ITEM_ROWS", raising=False)
    monkeypatch.setenv("ARTICLE_SCALE", "full")
    full = make_model()
    shapes = {k: (tuple(v.shape), v.device.type) for k, v in full.state_dict().items()}
    assert shapes["ebc.embedding_bags.t_user.weight"] == ((100_000_000, 64), "meta")
    assert shapes["ebc.embedding_bags.t_item.weight"] == ((50_000_000, 32), "meta")
    assert all(d == "cpu" for k, (_, d) in shapes.items() if not k.startswith("ebc."))
    monkeypatch.setenv("ARTICLE_SCALE", "huge")
    with pytest.raises(ValueError, match="ARTICLE_SCALE='huge'"):
        make_model()
    monkeypatch.setenv("ARTICLE_SCALE", "small")
    assert module.table_rows() == (200_000, 100_000)
    model = make_model(user_rows=50, item_rows=30).eval()
    from serve.model.export import model_schema

    schema = model_schema(model, module.NUM_DENSE, max_ids=module.MAX_IDS)
    assert [(t.name, t.rows, t.dim) for t in schema.tables] == [("t_user", 50, 64),
                                                                 ("t_item", 30, 32)]
    dense, values, lengths = generated_batch(schema, 5, seed=1)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["user_id", "item_id"], values=values,
                                              lengths=lengths.reshape(-1))
    with torch.no_grad():
        out = model(dense, kjt)
    assert out.shape == (5, 1) and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- checkpoint
@pytest.mark.parametrize("factory", [ARTICLE, DLRMV2], ids=["article", "dlrm_v2"])
def test_checkpoint_loads_with_stock_dcp_exactly_as_generated(
        tmp_path: Path, small: None, factory: str) -> None:
    out = write_checkpoint(factory, tmp_path / "ck", seed=7, ranks=3, chunk_rows=CHUNK,
                           stream=io.StringIO())
    want = _expected(factory, 7)
    got = _dcp_load(tmp_path / "ck", want)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    md = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    used = {info.relative_path for info in md.storage_data.values()}
    assert used == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    assert out["chunks"] == len(md.storage_data) and out["files"] == 3
    # every chunk is listed once, in its tensor's metadata and in the storage index
    for fqn, tmd in md.state_dict_metadata.items():
        assert sum(c.sizes[0] for c in tmd.chunks) == tmd.size[0], fqn


def test_a_table_spans_rank_files_and_the_seed_fixes_the_bytes(tmp_path: Path,
                                                               small: None) -> None:
    a = write_checkpoint(ARTICLE, tmp_path / "a", seed=3, ranks=2, chunk_rows=CHUNK,
                         stream=io.StringIO())
    write_checkpoint(ARTICLE, tmp_path / "b", seed=3, ranks=2, chunk_rows=CHUNK,
                     stream=io.StringIO())
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    md = pickle.loads((tmp_path / "a" / ".metadata").read_bytes())
    user = {info.relative_path for idx, info in md.storage_data.items()
            if idx.fqn == "ebc.embedding_bags.t_user.weight"}
    assert user == {"__0_0.distcp", "__1_0.distcp"}      # row-wise over both ranks
    # Other ranks and chunks, same seed: the same tensors; another seed: other tables.
    write_checkpoint(ARTICLE, tmp_path / "c", seed=3, ranks=5, chunk_rows=4 * BLOCK_ROWS,
                     stream=io.StringIO())
    write_checkpoint(ARTICLE, tmp_path / "d", seed=4, ranks=2, chunk_rows=CHUNK,
                     stream=io.StringIO())
    want = _expected(ARTICLE, 3)
    got_c, got_d = _dcp_load(tmp_path / "c", want), _dcp_load(tmp_path / "d", want)
    assert all(torch.equal(got_c[k], want[k]) for k in want)
    assert not torch.equal(got_d["ebc.embedding_bags.t_user.weight"],
                           want["ebc.embedding_bags.t_user.weight"])
    t = table_inits(seeded_model(ARTICLE, 3)[0])[0]
    w = want[t.fqn]
    assert float(w.min()) >= t.low and float(w.max()) < t.high and t.high == (1 / 300000) ** 0.5
    assert a["bytes"] >= 4 * (300000 * 64 + 70000 * 32)


def test_the_importer_imports_the_generated_article_checkpoint_exactly(
        tmp_path: Path, small: None, capsys: pytest.CaptureFixture) -> None:
    from serve.model.importer import main as importer_main

    assert main(["checkpoint", "--factory", ARTICLE, "--out", str(tmp_path / "ck"),
                 "--chunk-rows", str(CHUNK), "--ranks", "2"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["files"] == 2
    assert "rows/s" in cap.err and "GB/s" in cap.err
    rc = importer_main(["--factory", ARTICLE, "--checkpoint", str(tmp_path / "ck"),
                        "--version", "article-small", "--model-store", str(tmp_path / "store")])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["version"] == "article-small" and last["max_abs_diff"] <= 1e-6


def test_a_failed_checkpoint_leaves_nothing_and_options_are_checked(
        tmp_path: Path, small: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="multiple of 65536"):
        write_checkpoint(ARTICLE, tmp_path / "x", chunk_rows=1000)
    with pytest.raises(ConfigError, match="--ranks 0 must be >= 1"):
        write_checkpoint(ARTICLE, tmp_path / "x", ranks=0)
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError, match="exists"):
        write_checkpoint(ARTICLE, tmp_path / "exists")
    calls = {"n": 0}
    real = torch.save

    def failing(obj: object, f: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(obj, f)

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(ARTICLE, tmp_path / "y", chunk_rows=CHUNK, stream=io.StringIO())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


# ----------------------------------------------------------------------------- version
def _served(store: Path, version: str, tmp: Path):
    with zipfile.ZipFile(store / f"dlrm-{version}.mar") as z:
        (tmp / f"{version}.pt").write_bytes(z.read("artifact.pt"))
    return load_artifact(tmp / f"{version}.pt", tables_path=[store])


def test_a_generated_version_serves_the_rows_an_import_stores(tmp_path: Path,
                                                              small: None) -> None:
    store = tmp_path / "store"
    out = write_version(VersionConfig(factory=DLRMV2, version="v2-gen", model_store=store,
                                      seed=5, chunk_rows=CHUNK), stream=io.StringIO(),
                        say=lambda m: None)
    report = json.loads(Path(out["report"]).read_text())
    assert report["origin"] == "generate" and report["check"] is None
    art = _served(store, "v2-gen", tmp_path)
    assert art.files is not None and len(art.tables) == 26
    # Each table's rows: the generated float rows, quantized with FBGEMM as TorchRec does.
    model, _ = seeded_model(DLRMV2, 5)
    for i, t in enumerate(table_inits(model)):
        rows = torch.from_numpy(art.files.array(i).copy())
        assert torch.equal(rows, quantize_rows(table_rows_fp32(t, 5, 0, t.rows), "int8")), t.name
    # ... which is what the importer stores from a checkpoint of the same weights, and
    # both versions answer alike.
    write_checkpoint(DLRMV2, tmp_path / "ck", seed=5, chunk_rows=CHUNK, stream=io.StringIO())
    imp = import_model(ImportConfig(factory=DLRMV2, checkpoint=tmp_path / "ck",
                                    version="v2-imp", model_store=store), say=lambda m: None)
    assert imp["max_abs_diff"] <= 1e-6
    ref = _served(store, "v2-imp", tmp_path)
    for a, b in zip(art.tables, ref.tables, strict=True):
        assert torch.equal(a.data, b.data), a.name
    dense, values, lengths = generated_batch(art.schema, 32, seed=2)
    p = []
    for x in (art, ref):
        rt = Runtime(x, RuntimeConfig(device="cpu", cache_load_factor=1.0))
        try:
            p.append(rt.predict(dense, SparseBatch(values, lengths)))
        finally:
            rt.close()
    assert torch.isfinite(p[0]).all() and torch.equal(p[0], p[1])
    with pytest.raises(ConfigError, match="already exists"):
        write_version(VersionConfig(factory=DLRMV2, version="v2-gen", model_store=store))


def test_quantize_rows_matches_torchrec_for_every_dtype() -> None:
    from serve.model.export import model_schema, quantize_for_serving, tables_from_quantized

    make_model, module = load_factory(ARTICLE)
    model = make_model(user_rows=40, item_rows=24).eval()
    with torch.no_grad():
        for p in model.ebc.parameters():
            p.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    state = model.state_dict()
    for dtype in ("int8", "int4", "fp16", "fp32"):
        schema = model_schema(model, module.NUM_DENSE, dtype=dtype)
        tables = tables_from_quantized(quantize_for_serving(model, schema), schema)
        for t in tables:
            w = state[f"ebc.embedding_bags.{t.name}.weight"]
            assert torch.equal(quantize_rows(w, dtype), t.data), (dtype, t.name)


def test_progress_line_says_rows_per_second_and_eta() -> None:
    buf = io.StringIO()
    p = Progress(total_bytes=4_000_000_000, total_rows=1000, what="generate", stream=buf)
    p.add(500, 2_000_000_000)
    p.line(p.t0 + 10, done=False)
    assert "2.00 of 4.00 GB, 500 of 1,000 rows, 50 rows/s, 0.20 GB/s, ETA 10 s" in buf.getvalue()
    p.done()
    assert buf.getvalue().rstrip().endswith(" s") and "ETA" not in buf.getvalue().splitlines()[-1]


def test_cli_help_names_both_modes(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "checkpoint" in out and "version" in out
    assert main(["checkpoint", "--factory", "nope.py:f", "--out", "x"]) == 2
