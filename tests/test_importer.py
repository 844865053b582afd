"""The importer (serve.model.importer) and artifact format 2 in the runtime.

The user's own models (tests/fixtures/own_models.py): tables of different dims, a table
read by two features, mean pooling, DLRM_DCN, and our built-in DLRM through the same door.
Each import is checked against TorchRec's own quantized forward; here we also check the
runtime's paths that the import check does not take (cache, updates, format 1).
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from serve.errors import ArtifactError, CheckpointError, ConfigError
from serve.model.importer import (
    ImportConfig,
    check_artifact,
    generated_batch,
    import_model,
    load_factory,
    main,
)
from serve.profiles import schema_from_report
from serve.runtime.artifact import FORMAT_VERSION, load_artifact, save_artifact, write_tables
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch
from serve.store.repository import ModelRepository

FIXTURE = Path(__file__).parent / "fixtures" / "own_models.py"


def _factory(name: str) -> str:
    return f"{FIXTURE}:{name}"


@pytest.fixture(scope="module")
def ranker_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fn, _ = load_factory(_factory("make_ranker"))
    path = tmp_path_factory.mktemp("ckpt") / "ranker.pt"
    model = fn()
    with torch.no_grad():   # non-zero, distinct rows everywhere (TorchRec inits are small)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    torch.save(model.state_dict(), path)
    return path


def _cfg(tmp_path: Path, factory: str, ckpt: Path, version: str = "own-a", **kw) -> ImportConfig:
    return ImportConfig(factory=_factory(factory), checkpoint=ckpt, version=version,
                        model_store=tmp_path / "store", **kw)


def _own_artifact(ckpt: Path, **schema_kw):
    """(artifact, quantized TorchRec model) of the ranker, built as the importer does."""
    from serve.model.export import (
        export_dense,
        model_schema,
        quantize_for_serving,
        tables_from_quantized,
    )
    from serve.model.importer import load_checkpoint
    from serve.runtime.artifact import Artifact

    fn, mod = load_factory(_factory("make_ranker"))
    model = load_checkpoint(fn(), ckpt).eval()
    schema = model_schema(model, mod.NUM_DENSE, max_ids=mod.MAX_IDS, **schema_kw)
    q = quantize_for_serving(model, schema)
    return Artifact(schema, tables_from_quantized(q, schema), export_dense(model, schema)), q


def test_import_own_model_from_a_state_dict_is_exact(tmp_path: Path, ranker_ckpt: Path) -> None:
    out = import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt), say=lambda m: None)
    assert out["version"] == "own-a" and out["max_abs_diff"] <= 1e-6
    repo = ModelRepository([tmp_path / "store"])
    assert repo.versions() == ["own-a"]
    report = repo.report("own-a")
    assert report["dense_kind"] == "export" and report["check"]["max_abs_diff"] <= 1e-6
    assert report["table_bytes"] == {"t_user": 1000 * 36, "t_item": 2000 * 20, "t_tag": 50 * 12}
    sparse = {f["name"]: f for f in report["schema"]["features"]}
    assert sparse["history"] == {"name": "history", "table": "t_item", "max_ids": 20}
    assert [t["pooling"] for t in report["schema"]["tables"]] == ["sum", "sum", "mean"]
    # the factory's CONTEXT_FEATURES, in the schema's order: what bench-slo sends once
    assert report["context_features"] == ["user_id", "history"]
    from argparse import Namespace

    from bench.bench_slo import context_features
    assert context_features(report, Namespace(context_features="")) == ("user_id", "history")
    assert context_features(report, Namespace(context_features="tags")) == ("tags",)


def test_meta_factory_mixed_dtypes_and_cli_json_line(tmp_path: Path, ranker_ckpt: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    rc = main(["--factory", _factory("make_ranker_meta"), "--checkpoint", str(ranker_ckpt),
               "--version", "own-mixed", "--model-store", str(tmp_path / "store"),
               "--table-dtype", "t_user=fp16", "--table-dtype", "t_tag=fp32",
               "--check-batch", "200", "--seed", "3"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["version"] == "own-mixed" and last["max_abs_diff"] <= 1e-6
    dtypes = [t["dtype"] for t in
              ModelRepository([tmp_path / "store"]).report("own-mixed")["schema"]["tables"]]
    assert dtypes == ["fp16", "int8", "fp32"]


def test_dlrm_dcn_and_builtin_dlrm_import_exactly(tmp_path: Path) -> None:
    for factory, n, kind in (("make_dcn", 32, "export"), ("make_builtin_tiny", 13, "dlrm")):
        fn, _ = load_factory(_factory(factory))
        ckpt = tmp_path / f"{factory}.pt"
        torch.save(fn().state_dict(), ckpt)
        out = import_model(_cfg(tmp_path, factory, ckpt, version=factory.replace("_", "-"),
                                num_dense=n, default_max_ids=3), say=lambda m: None)
        assert out["max_abs_diff"] <= 1e-6, factory
        report = ModelRepository([tmp_path / "store"]).report(out["version"])
        assert report["dense_kind"] == kind


@pytest.mark.parametrize("damage,match", [
    ("missing", r"missing keys \['top\.2\.bias'\], unexpected keys \[\]"),
    ("unexpected", r"missing keys \[\], unexpected keys \['extra\.weight'\]"),
    ("shape", r"ebc\.embedding_bags\.t_tag\.weight has shape \(49, 8\), the model needs \(50, 8\)"),
])
def test_bad_checkpoints_name_the_key_and_leave_the_store_unchanged(
        tmp_path: Path, ranker_ckpt: Path, damage: str, match: str) -> None:
    state = torch.load(ranker_ckpt, weights_only=True)
    if damage == "missing":
        del state["top.2.bias"]
    elif damage == "unexpected":
        state["extra.weight"] = torch.zeros(2)
    else:
        state["ebc.embedding_bags.t_tag.weight"] = torch.zeros(49, 8)
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(CheckpointError, match=match):
        import_model(_cfg(tmp_path, "make_ranker", bad), say=lambda m: None)
    assert os.listdir(store) == []


def test_a_forward_outside_the_contract_is_refused(tmp_path: Path) -> None:
    fn, _ = load_factory(_factory("make_two_logits"))
    ckpt = tmp_path / "two.pt"
    torch.save(fn().state_dict(), ckpt)
    with pytest.raises(ConfigError, match=r"returned torch\.float32 \(3, 2\) for a batch of 3; "
                                          r"the contract is logits of shape \(B,\) or \(B, 1\)"):
        import_model(_cfg(tmp_path, "make_two_logits", ckpt), say=lambda m: None)
    assert not (tmp_path / "store").exists() or os.listdir(tmp_path / "store") == []


def test_bad_options_are_named(tmp_path: Path, ranker_ckpt: Path) -> None:
    with pytest.raises(ConfigError, match=r"defines no 'nope'"):
        import_model(_cfg(tmp_path, "nope", ranker_ckpt), say=lambda m: None)
    with pytest.raises(ConfigError, match=r"--table-dtype names tables \['t_nope'\]"):
        import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt, table_dtypes={"t_nope": "fp16"}),
                     say=lambda m: None)
    with pytest.raises(ConfigError, match=r"--dtype 'int3' must be one of"):
        _cfg(tmp_path, "make_ranker", ranker_ckpt, dtype="int3")


def test_a_check_that_differs_refuses_the_import(tmp_path: Path, ranker_ckpt: Path) -> None:
    art, q = _own_artifact(ranker_ckpt)
    with torch.no_grad():
        art.tables[2].data[:, 4:] = 0   # t_tag's codes lost: the model no longer matches
    res = check_artifact(art, q, batch=16, seed=0, tolerance=1e-6)
    assert not res.passed and res.max_abs_diff > 1e-6


def _batches(schema, n: int = 4):
    return [generated_batch(schema, b, seed=b) for b in (1, 2, 33, 130)[:n]]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_mixed_dims_cached_equals_uncached(ranker_ckpt: Path, policy: str) -> None:
    art, _ = _own_artifact(ranker_ckpt, table_dtypes={"t_user": "fp16"})
    plain = Runtime(art, RuntimeConfig(cache_load_factor=1.0))
    cached = Runtime(art, RuntimeConfig(cache_load_factor=0.2, cache_on_cpu=True,
                                        cache_policy=policy))
    assert cached.cache is not None and cached.cache.capacity < cached.total_rows
    for _ in range(3):  # again: hits the second time round
        for dense, values, lengths in _batches(art.schema):
            want = plain.predict(dense, SparseBatch(values, lengths))
            got = cached.predict(dense, SparseBatch(values, lengths))
            assert torch.equal(got, want)
    st = cached.stats()
    assert st.misses > 0 and st.hits > 0
    cached.close()


def test_update_of_the_shared_table_equals_a_rebuild(ranker_ckpt: Path) -> None:
    art, _ = _own_artifact(ranker_ckpt)
    g = torch.Generator().manual_seed(5)
    t = art.schema.table_index("t_item")
    ids = torch.unique(torch.randint(0, 2000, (300,), generator=g))
    new_rows = torch.randint(0, 256, (ids.numel(), art.tables[t].data.shape[1]),
                             dtype=torch.uint8, generator=g)
    new_rows[:, :4] = art.tables[t].data[ids, :4]   # keep sane fp16 scale/bias
    rebuilt = copy.deepcopy(art)
    rebuilt.tables[t].data[ids] = new_rows
    for cfg in (RuntimeConfig(cache_load_factor=1.0),
                RuntimeConfig(cache_load_factor=0.2, cache_on_cpu=True)):
        live, ref = Runtime(art, cfg), Runtime(rebuilt, cfg)
        dense, values, lengths = generated_batch(art.schema, 64, seed=1)
        before = live.predict(dense, SparseBatch(values, lengths))
        live.update_rows(t, ids, new_rows)   # the table's own width (20 bytes, stored at 36)
        after = live.predict(dense, SparseBatch(values, lengths))
        assert torch.equal(after, ref.predict(dense, SparseBatch(values, lengths)))
        assert not torch.equal(before, after)  # both item_id and history read the new rows
        live.close()
        ref.close()


def test_format_3_2_round_trip_and_format_1_still_loads(tmp_path: Path, ranker_ckpt: Path) -> None:
    """In memory: format 2 (tables in the file); with its tables written to a tables
    folder: format 3 (a reference), found beside the artifact or on the search path;
    all three give the same probabilities; format 1 still loads."""
    art, _ = _own_artifact(ranker_ckpt)
    save_artifact(art, tmp_path / "a.pt")
    back = load_artifact(tmp_path / "a.pt")
    assert torch.load(tmp_path / "a.pt", weights_only=True)["format_version"] == 2
    assert back.schema == art.schema and back.files is None
    on_disk = write_tables(art, tmp_path / "store" / "dlrm-x.tables")
    save_artifact(on_disk, tmp_path / "a3.pt")
    blob = torch.load(tmp_path / "a3.pt", weights_only=True)
    assert FORMAT_VERSION == blob["format_version"] == 3 and set(blob["tables"]) == {"ref", "identity"}
    # the reference replaces every table byte
    assert ((tmp_path / "a3.pt").stat().st_size
            <= (tmp_path / "a.pt").stat().st_size - art.table_bytes + 4096)
    with pytest.raises(ArtifactError, match="dlrm-x.tables is in none of"):
        load_artifact(tmp_path / "a3.pt", tables_path=[])
    back3 = load_artifact(tmp_path / "a3.pt", tables_path=[tmp_path / "store"])
    assert back3.files is not None
    dense, values, lengths = generated_batch(art.schema, 20, seed=2)
    outs = [Runtime(a, RuntimeConfig(cache_load_factor=1.0)).predict(dense, SparseBatch(values, lengths))
            for a in (art, back, back3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

    from serve.model.export import artifact_from_float_dlrm
    from serve.model.importer import load_factory as lf

    fn, _ = lf(_factory("make_builtin_tiny"))
    v2 = artifact_from_float_dlrm(fn(), dtype="int8")
    v1 = {"format_version": 1, "feature_names": v2.feature_names, "num_dense": 13,
          "embedding_dim": v2.embedding_dim, "dtype": "int8",
          "tables": [{"name": t.name, "feature": v2.table_feature(i), "rows": t.rows,
                      "dim": t.dim, "dtype": t.dtype, "data": t.data}
                     for i, t in enumerate(v2.tables)],
          "dense_arch": v2.dense.dense_arch, "over_arch": v2.dense.over_arch, "meta": {}}
    torch.save(v1, tmp_path / "v1.pt")
    old = load_artifact(tmp_path / "v1.pt")
    assert old.schema == v2.schema and old.schema.max_ids == (64,) * 26
    dense, values, lengths = generated_batch(v2.schema, 9, seed=0)
    assert torch.equal(Runtime(old, RuntimeConfig()).predict(dense, SparseBatch(values, lengths)),
                       Runtime(v2, RuntimeConfig()).predict(dense, SparseBatch(values, lengths)))


def test_schema_mismatch_inside_an_artifact_is_an_error(ranker_ckpt: Path) -> None:
    from serve.runtime.artifact import Artifact

    art, _ = _own_artifact(ranker_ckpt)
    with pytest.raises(ArtifactError, match=r"the schema has 3 tables, the artifact 2"):
        Artifact(art.schema, art.tables[:2], art.dense)


def test_the_launchers_ready_probe_speaks_an_imported_schema(tmp_path: Path,
                                                              ranker_ckpt: Path) -> None:
    """``make up`` waits for a real predict: for an imported version the built-in request
    is a 400, so the probe asks again in the schema of the version that answered."""
    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launcher import _example_for

    import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt), say=lambda m: None)
    cfg = LaunchConfig(model_store=tmp_path / "store")
    body = _example_for(cfg, "own-a")
    assert body is not None
    schema = schema_from_report(ModelRepository([tmp_path / "store"]).report("own-a"))
    parsed = parse_body(body, HandlerConfig(), schema=schema)
    assert parsed.lengths.shape == (4, 1)
    assert _example_for(cfg, "not-there") is None and _example_for(cfg, None) is None


def test_the_stored_program_loads_where_torchrec_and_fbgemm_do_not(tmp_path: Path) -> None:
    """examples/own_ranker regroups its pooled embeddings with KeyedTensor.regroup, whose
    fast path is an FBGEMM operator: the export takes TorchRec's plain path instead, and
    the artifact runs in a process that refuses to import torchrec and fbgemm_gpu (the
    pod), with the same probabilities."""
    import subprocess
    import sys
    import zipfile

    factory = f"{Path(__file__).parents[1] / 'examples' / 'own_ranker' / 'model.py'}:make_model"
    fn, _ = load_factory(factory)
    ckpt = tmp_path / "ranker.pt"
    torch.save(fn().state_dict(), ckpt)
    out = import_model(ImportConfig(factory=factory, checkpoint=ckpt, version="ranker-x",
                                    model_store=tmp_path / "store"), say=lambda m: None)
    with zipfile.ZipFile(out["archive"]) as z:
        (tmp_path / "a.pt").write_bytes(z.read("artifact.pt"))
    art = load_artifact(tmp_path / "a.pt", tables_path=[tmp_path / "store"])
    assert art.files is not None and art.files.folder.parent == tmp_path / "store"
    dense, values, lengths = generated_batch(art.schema, 16, seed=9)
    torch.save({"dense": dense, "values": values, "lengths": lengths}, tmp_path / "in.pt")
    want = Runtime(art, RuntimeConfig()).predict(dense, SparseBatch(values, lengths))
    code = (
        "import importlib.abc, sys, torch\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torchrec', 'fbgemm_gpu'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch\n"
        f"b = torch.load({str(tmp_path / 'in.pt')!r})\n"
        f"rt = Runtime.from_artifact({str(tmp_path / 'a.pt')!r}, RuntimeConfig(), "
        f"tables_path=[{str(tmp_path / 'store')!r}])\n"
        "p = rt.predict(b['dense'], SparseBatch(b['values'], b['lengths']))\n"
        f"torch.save(p, {str(tmp_path / 'out.pt')!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), want)


def test_operators_stock_pytorch_lacks_are_named() -> None:
    from serve.model.export import foreign_ops

    lib = torch.library.Library("dlrmtest", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
    lib.impl("twice", lambda x: torch.empty_like(x), "Meta")

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.dlrmtest.twice(x).relu()

    ep = torch.export.export(M(), (torch.zeros(2, 3),), strict=False)
    assert foreign_ops(ep) == ["dlrmtest.twice.default"]
    plain = torch.export.export(torch.nn.Linear(3, 1), (torch.zeros(2, 3),), strict=False)
    assert foreign_ops(plain) == []


def test_the_banner_curl_speaks_the_declared_versions_schema(tmp_path: Path,
                                                             ranker_ckpt: Path) -> None:
    import types

    from serve.api.config import HandlerConfig
    from serve.api.decode import parse_body
    from serve.ops.launch_config import LaunchConfig
    from serve.ops.launch_state import ensure_state
    from serve.ops.launcher import Service, _banner

    import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt), say=lambda m: None)
    cfg = LaunchConfig(model_store=tmp_path / "store", state_file=tmp_path / "state.yaml")
    state, _ = ensure_state(cfg.path(cfg.state_file), cfg.repository(), "own-a")
    proc = types.SimpleNamespace(pid=1)
    text = _banner(Service(cfg, proc, sidecar=proc, ready_s=1.0, state=state))  # type: ignore[arg-type]
    body = text.split(" -d '", 1)[1].split("'\n", 1)[0]
    schema = schema_from_report(ModelRepository([tmp_path / "store"]).report("own-a"))
    assert parse_body(body.encode(), HandlerConfig(), schema=schema).dense.shape == (1, 8)


def test_the_archive_admits_the_models_largest_max_ids(tmp_path: Path, ranker_ckpt: Path) -> None:
    """The handler's own cap (64 by default) must not refuse what the model accepts."""
    import zipfile

    import yaml

    out = import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt, max_ids={"history": 100}),
                       say=lambda m: None)
    with zipfile.ZipFile(out["archive"]) as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert cfg["handler"]["max_ids_per_feature"] == 100


def test_import_with_dense_bf16_is_gated_recorded_and_served(tmp_path: Path,
                                                            ranker_ckpt: Path) -> None:
    """--dense-precision bf16: the exact fp32 check still runs; the bf16 gate bounds
    |p_bf16 - p_fp32| on the check batch; the archive serves bf16."""
    import zipfile

    import yaml

    lines: list[str] = []
    out = import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt, version="own-bf16",
                            dense_precision="bf16"), say=lines.append)
    assert out["max_abs_diff"] <= 1e-6   # the fp32 artifact is still TorchRec's, exactly
    rep = ModelRepository([tmp_path / "store"]).report("own-bf16")["dense_precision"]
    assert rep["precision"] == "bf16" and rep["tolerance"] == 0.01
    assert 0.0 < rep["max_abs_diff_vs_fp32"] <= 0.01
    assert any("dense bf16: max |p_bf16 - p_fp32|" in ln for ln in lines)
    with zipfile.ZipFile(out["archive"]) as z:
        cfg = yaml.safe_load(z.read("model-config.yaml"))
    assert cfg["handler"]["dense_precision"] == "bf16"
    # fp32 imports keep the handler config they had
    fp = import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt, version="own-fp32"),
                      say=lambda m: None)
    with zipfile.ZipFile(fp["archive"]) as z:
        assert "dense_precision" not in yaml.safe_load(z.read("model-config.yaml"))["handler"]
    assert "dense_precision" not in ModelRepository([tmp_path / "store"]).report("own-fp32")


def test_dense_bf16_gate_refuses_past_its_tolerance_and_bad_options(tmp_path: Path,
                                                                   ranker_ckpt: Path) -> None:
    with pytest.raises(ArtifactError, match=r"dense bf16 moves the probabilities by .* > 0 "
                                            r"\(--dense-tolerance\); nothing was written"):
        import_model(_cfg(tmp_path, "make_ranker", ranker_ckpt, dense_precision="bf16",
                          dense_tolerance=0.0), say=lambda m: None)
    assert not (tmp_path / "store").exists() or ModelRepository([tmp_path / "store"]).versions() == []
    with pytest.raises(ConfigError, match=r"--dense-precision 'int8' must be fp32 or bf16"):
        _cfg(tmp_path, "make_ranker", ranker_ckpt, dense_precision="int8")
    with pytest.raises(ConfigError, match=r"--dense-tolerance -1.0 must be a float >= 0"):
        _cfg(tmp_path, "make_ranker", ranker_ckpt, dense_tolerance=-1.0)


def test_exported_dense_runs_in_bf16_close_to_fp32_and_refuses_int8(ranker_ckpt: Path) -> None:
    art, _ = _own_artifact(ranker_ckpt)
    dense, values, lengths = generated_batch(art.schema, 64, seed=1)
    p = {}
    for prec in ("fp32", "bf16"):
        rt = Runtime(art, RuntimeConfig(device="cpu", cache_load_factor=1.0, dense_precision=prec))
        p[prec] = rt.predict(dense, SparseBatch(values, lengths))
        assert p[prec].dtype == torch.float32
        rt.close()
    diff = float((p["bf16"] - p["fp32"]).abs().max())
    assert 0.0 < diff < 0.01
    with pytest.raises(ConfigError, match="'int8' applies to the built-in DLRM only"):
        Runtime(art, RuntimeConfig(device="cpu", dense_precision="int8"))


def _context_pair(schema, ctx: set[str], n: int, seed: int, dense_ctx: bool = True):
    """The same ranking request as (context body, instances body) for ``schema``: the
    ``ctx`` features (and the dense vector) equal across its n candidates."""
    import orjson

    from serve.api.context_body import ranking_request
    from serve.api.spec import spec_of
    from tests.fixtures.ranking import instances_body, ranking_arrays

    spec = spec_of(schema)
    arrays = ranking_arrays(spec, n, seed, ctx, dense_ctx=dense_ctx, id_high=5000, max_len=4)
    return (orjson.dumps(ranking_request(*arrays, ctx, dense_in_context=dense_ctx, spec=spec)),
            orjson.dumps(instances_body(spec, *arrays)))


@pytest.mark.parametrize("cache", [False, True])
def test_context_form_equals_the_instances_for_an_imported_model(ranker_ckpt: Path,
                                                                 cache: bool) -> None:
    """The own ranker: ``history`` (context) and ``item_id`` (per candidate) read one
    table, ``tags`` is mean-pooled; context and instances give the same bits, cache on
    and off, one request and a TorchServe batch of three."""
    from serve.api.config import HandlerConfig
    from serve.worker.arms import handle_batch

    art, _ = _own_artifact(ranker_ckpt)
    rt = Runtime.from_artifact(art, RuntimeConfig(cache_on_cpu=cache,
                                                  cache_load_factor=0.2 if cache else None))
    ctx = {"user_id", "history"}
    pairs = [_context_pair(art.schema, ctx, n, seed) for n, seed in ((17, 1), (1, 2), (40, 3))]
    pairs.append(_context_pair(art.schema, {"tags"}, 9, 4, dense_ctx=False))

    def fwd(m):
        return rt.predict_arrays(m.dense, m.values, m.lengths, m.shared, m.bag_of)

    cfg = HandlerConfig()
    got, _ = handle_batch([c for c, _ in pairs], [None] * len(pairs), fwd, cfg, schema=art.schema)
    want, _ = handle_batch([i for _, i in pairs], [None] * len(pairs), fwd, cfg,
                           schema=art.schema)
    assert [o.status for o in got] == [200] * len(pairs), [o.body[:200] for o in got]
    assert [o.body for o in got] == [o.body for o in want]


def test_context_form_equals_the_instances_for_the_articles_dcn(tmp_path: Path) -> None:
    from serve.api.config import HandlerConfig
    from serve.worker.arms import handle_batch

    fn, _ = load_factory(_factory("make_dcn"))
    ckpt = tmp_path / "dcn.pt"
    torch.save(fn().state_dict(), ckpt)
    out = import_model(_cfg(tmp_path, "make_dcn", ckpt, version="dcn-a", num_dense=32,
                            default_max_ids=3), say=lambda m: None)
    from serve.store.repository import extract_artifact

    repo = ModelRepository([tmp_path / "store"])
    assert repo.report(out["version"])["context_features"] == ["user_id"]
    (tmp_path / "x").mkdir()
    art = load_artifact(extract_artifact(repo.archive(out["version"]), tmp_path / "x"))
    rt = Runtime.from_artifact(art)
    body_ctx, body_inst = _context_pair(art.schema, {"user_id"}, 25, 7)

    def fwd(m):
        return rt.predict_arrays(m.dense, m.values, m.lengths, m.shared, m.bag_of)

    got, _ = handle_batch([body_ctx], [None], fwd, HandlerConfig(), schema=art.schema)
    want, _ = handle_batch([body_inst], [None], fwd, HandlerConfig(), schema=art.schema)
    assert got[0].status == 200 and got[0].body == want[0].body
