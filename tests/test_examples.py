"""The own-model examples (examples/*/model.py) and their trainer, serve.model.fit.

Fast tests build each factory with few rows and run a forward on a generated batch; the
slow one trains own_ranker over 2 real gloo ranks and checks the merged state dict against
the sharded model's logits.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve.errors import ConfigError
from serve.model.fit import (
    FIT_FILE,
    FIXED_BATCH_FILE,
    FitConfig,
    ModelContractError,
    SyntheticData,
    build_model,
    check_forward,
    embedding_bag_collections,
    feature_order,
    feature_specs,
    load_factory,
    main,
    plan_table_wise,
    resolve_num_dense,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _factory(name: str):
    """(make_model, module) of examples/<name>/model.py, imported by path as fit does."""
    return load_factory(f"{EXAMPLES / name / 'model.py'}:make_model")


def _ebc_features(model: torch.nn.Module) -> list[str]:
    """Every EBC's features in config order (tables in order, feature_names in order)."""
    return [f for _, ebc in embedding_bag_collections(model)
            for cfg in ebc.embedding_bag_configs() for f in cfg.feature_names]


def _forward_checked(model: torch.nn.Module, module, b: int = 8) -> torch.Tensor:
    specs = feature_specs(model, module.MAX_IDS)
    data = SyntheticData(specs, resolve_num_dense(None, module), seed=3)
    batch = data.batch(rank=0, step=0, b=b)
    assert batch.sparse.keys() == feature_order(model) == _ebc_features(model)
    lengths = batch.sparse.lengths().view(len(specs), b)
    for s, ln in zip(specs, lengths, strict=True):
        assert int(ln.min()) >= 1 and int(ln.max()) <= s.max_ids, s
    assert int(batch.sparse.values().min()) >= 0
    per_key = batch.sparse.to_dict()
    for s in specs:
        assert int(per_key[s.name].values().max()) < s.rows
    model.eval()
    with torch.no_grad():
        out = model(batch.dense, batch.sparse)
    assert out.dtype == torch.float32 and tuple(out.shape) in ((b,), (b, 1))
    assert torch.isfinite(out).all()
    return out


# ----------------------------------------------------------------------------- factories

def test_article_dcn_builds_and_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARTICLE_DCN_USER_ROWS", "300")
    monkeypatch.setenv("ARTICLE_DCN_ITEM_ROWS", "200")
    make_model, module = _factory("article_dcn")
    model = make_model()
    assert module.NUM_DENSE == 256
    cfgs = {c.name: c for _, e in embedding_bag_collections(model)
            for c in e.embedding_bag_configs()}
    assert {n: (c.num_embeddings, c.embedding_dim) for n, c in cfgs.items()} == {
        "user_id": (300, 64), "item_id": (200, 64)}
    _forward_checked(model, module)
    small = make_model(user_rows=10, item_rows=20)  # the argument wins over the env var
    assert [c.num_embeddings for _, e in embedding_bag_collections(small)
            for c in e.embedding_bag_configs()] == [10, 20]


def test_dlrm_v2_builds_capped_and_runs() -> None:
    make_model, module = _factory("dlrm_v2")
    model = make_model(max_rows=100)
    cfgs = [c for _, e in embedding_bag_collections(model) for c in e.embedding_bag_configs()]
    assert [c.name for c in cfgs] == [f"t_cat_{i}" for i in range(26)]
    assert [c.num_embeddings for c in cfgs] == [min(r, 100) for r in module.MLPERF_ROWS]
    assert {c.embedding_dim for c in cfgs} == {128}
    assert [module.MAX_IDS[f"cat_{i}"] for i in range(26)] == module.MLPERF_MULTI_HOT
    assert module.NUM_DENSE == 13
    _forward_checked(model, module, b=4)


def test_dlrm_v2_row_cap_env_and_full_size(monkeypatch: pytest.MonkeyPatch) -> None:
    _, module = _factory("dlrm_v2")
    monkeypatch.delenv("DLRMV2_MAX_ROWS", raising=False)
    assert max(module.table_rows()) == 20_000
    monkeypatch.setenv("DLRMV2_MAX_ROWS", "0")
    assert module.table_rows() == module.MLPERF_ROWS
    monkeypatch.setenv("DLRMV2_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="DLRMV2_MAX_ROWS"):
        module.table_rows()
    # Full MLPerf rows (~100 GB of fp32): the tables are built on meta, nothing allocated.
    full = module.make_model(max_rows=0)
    ebc = embedding_bag_collections(full)[0][1]
    assert all(p.is_meta for p in ebc.parameters())


def test_own_ranker_builds_and_runs() -> None:
    make_model, module = _factory("own_ranker")
    model = make_model(user_rows=50, item_rows=40, cat_rows=5, tag_rows=7)
    specs = {s.name: s for s in feature_specs(model, module.MAX_IDS)}
    assert list(specs) == ["user_id", "item_id", "history", "category", "tags"]
    assert specs["history"].table == specs["item_id"].table == "t_item"
    assert (specs["history"].max_ids, specs["tags"].max_ids) == (20, 5)
    assert (specs["tags"].pooling, specs["user_id"].pooling) == ("MEAN", "SUM")
    assert {s.dim for s in specs.values()} == {32, 16, 8}
    out = _forward_checked(model, module)
    assert out.shape == (8, 1)


def test_own_ranker_columns_do_not_depend_on_key_order() -> None:
    """The model reads pooled columns by feature name, so a KJT (or a sharded EBC's
    KeyedTensor) with the keys in another order gives the same logits."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    make_model, module = _factory("own_ranker")
    model = make_model(user_rows=50, item_rows=40, cat_rows=5, tag_rows=7).eval()
    data = SyntheticData(feature_specs(model, module.MAX_IDS), module.NUM_DENSE, seed=1)
    b = data.fixed_batch(6)
    d = b.sparse.to_dict()
    keys = list(reversed(b.sparse.keys()))
    shuffled = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat([d[k].values() for k in keys]),
        lengths=torch.cat([d[k].lengths() for k in keys]))
    with torch.no_grad():
        assert torch.equal(model(b.dense, b.sparse), model(b.dense, shuffled))


def test_table_wise_plan_places_every_table() -> None:
    make_model, _ = _factory("own_ranker")
    plan = plan_table_wise(make_model(user_rows=50, item_rows=40, cat_rows=5, tag_rows=7),
                           world_size=2, batch_size=16)
    ebc_plan = plan.plan["ebc"]
    assert set(ebc_plan) == {"t_user", "t_item", "t_cat", "t_tag"}
    assert {ps.sharding_type for ps in ebc_plan.values()} == {"table_wise"}
    assert {r for ps in ebc_plan.values() for r in ps.ranks} == {0, 1}


def test_synthetic_data_is_seeded_and_rank_sliced() -> None:
    make_model, module = _factory("own_ranker")
    specs = feature_specs(make_model(user_rows=50, item_rows=40, cat_rows=5, tag_rows=7),
                          module.MAX_IDS)
    a, b = SyntheticData(specs, 8, seed=0), SyntheticData(specs, 8, seed=0)
    x, y = a.batch(0, 3, 32), b.batch(0, 3, 32)
    assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
    assert torch.equal(x.sparse.values(), y.sparse.values())
    assert not torch.equal(x.dense, a.batch(1, 3, 32).dense)
    assert set(x.labels.unique().tolist()) <= {0.0, 1.0}
    z = SyntheticData(specs, 8, seed=0, ids="zipf").batch(0, 0, 64)
    assert int(z.sparse.to_dict()["user_id"].values().max()) < 50


# ----------------------------------------------------------------------------- contract

_BAD = '''
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

NUM_DENSE = 3


class Pooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])

    def forward(self, dense, kjt):
        return self.ebc(kjt).values()          # (B, 4): not logits


def wrong_shape():
    return Pooled()


def not_a_module():
    return 3


def no_ebc():
    return torch.nn.Linear(3, 1)


NOT_CALLABLE = 1
'''


@pytest.fixture
def bad_factory(tmp_path: Path) -> Path:
    p = tmp_path / "bad_model.py"
    p.write_text(_BAD)
    return p


@pytest.mark.parametrize("func, message", [
    ("missing", "defines no 'missing'"),
    ("NOT_CALLABLE", "is not callable"),
    ("not_a_module", "not a torch.nn.Module"),
    ("no_ebc", "no torchrec.EmbeddingBagCollection"),
])
def test_bad_factories_are_contract_errors(bad_factory: Path, func: str, message: str) -> None:
    with pytest.raises(ModelContractError, match=message):
        build_model(f"{bad_factory}:{func}")


def test_forward_that_breaks_the_contract(bad_factory: Path) -> None:
    model, module = build_model(f"{bad_factory}:wrong_shape")
    data = SyntheticData(feature_specs(model), resolve_num_dense(None, module), seed=0)
    with pytest.raises(ModelContractError, match=r"shape \(4, 4\)"):
        check_forward(model, data)


@pytest.mark.parametrize("factory, message", [
    ("nope/model.py:make_model", "no file nope/model.py"),
    ("examples/own_ranker/model.py", "must be FILE.py:FUNCTION"),
    ("BAD:wrong_shape", "the contract is logits"),
    ("examples/own_ranker/model.py:make_model --num-dense 5", "mat1 and mat2"),
])
def test_cli_errors_are_one_line_exit_2(bad_factory: Path, tmp_path: Path, factory: str,
                                        message: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = factory.replace("BAD", str(bad_factory)).split()
    monkeypatch.chdir(ROOT)
    rc = main(["--factory", *args[:1], "--out", str(tmp_path / "ckpt"), *args[1:]])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: ") and "\n" not in err and message in err
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.tmp").exists()


def test_num_dense_must_come_from_somewhere(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text(_BAD.replace("NUM_DENSE = 3", ""))
    _, module = build_model(f"{p}:wrong_shape")
    with pytest.raises(ModelContractError, match="--num-dense N or define NUM_DENSE"):
        resolve_num_dense(None, module)
    assert resolve_num_dense(7, module) == 7


def test_max_ids_naming_an_unknown_feature(bad_factory: Path) -> None:
    model, _ = build_model(f"{bad_factory}:wrong_shape")
    with pytest.raises(ModelContractError, match="MAX_IDS names"):
        feature_specs(model, {"g": 3})


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "--world-size"),
    ({"steps": 0}, "--steps"),
    ({"batch_size": 1, "world_size": 2}, "--batch-size"),
    ({"lr": -1.0}, "--lr"),
    ({"dense_lr": float("nan")}, "--dense-lr"),
    ({"optimizer": "adam"}, "--optimizer"),
    ({"factory": "no_colon"}, "FILE.py:FUNCTION"),
])
def test_fit_config_validates(kwargs: dict, message: str) -> None:
    base = {"factory": "m.py:f", "out_dir": Path("x")}
    with pytest.raises(ConfigError, match=message):
        FitConfig(**{**base, **kwargs})


def test_help_names_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "serve.model.fit", "--help"], check=False,
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--factory", "--out", "--world-size", "--steps", "--batch-size", "--seed",
                 "--lr", "--dense-lr", "--num-dense", "--state-dict"):
        assert flag in out.stdout


# ----------------------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.integration
def test_fit_own_ranker_two_ranks_then_merge(tmp_path: Path) -> None:
    """2 gloo ranks train own_ranker; the DCP merges into a plain state dict that the
    factory's unsharded model loads strictly and that reproduces the sharded logits."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ckpt, sd = tmp_path / "ckpt", tmp_path / "model.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "serve.model.fit",
         "--factory", "examples/own_ranker/model.py:make_model", "--out", str(ckpt),
         "--world-size", "2", "--steps", "6", "--batch-size", "128", "--state-dict", str(sd)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["checkpoint"] == str(ckpt) and summary["state_dict"] == str(sd)
    assert (summary["steps"], summary["world_size"]) == (6, 2)
    assert summary["merged_max_abs_diff"] is not None and summary["merged_max_abs_diff"] < 1e-5
    assert {p.name for p in ckpt.iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp",
                                                FIT_FILE, FIXED_BATCH_FILE}
    meta = json.loads((ckpt / FIT_FILE).read_text())
    assert [f["name"] for f in meta["features"]] == ["user_id", "item_id", "history",
                                                     "category", "tags"]
    assert sorted({r for rs in meta["table_ranks"].values() for r in rs}) == [0, 1]

    make_model, _ = _factory("own_ranker")
    model = make_model()
    state = torch.load(sd, weights_only=True)
    model.load_state_dict(state, strict=True)
    # The file is what a direct merge of the DCP directory gives.
    raw = tmp_path / "direct.pt"
    dcp_to_torch_save(str(ckpt), str(raw))
    direct = torch.load(raw, weights_only=True)
    assert direct.keys() == state.keys()
    assert all(torch.equal(direct[k], state[k]) for k in state)

    fixed = torch.load(ckpt / FIXED_BATCH_FILE, weights_only=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=fixed["keys"], values=fixed["values"],
                                              lengths=fixed["lengths"])
    with torch.no_grad():
        merged = model.eval()(fixed["dense"], kjt).reshape(-1)
    assert torch.allclose(merged, fixed["logits"], atol=1e-5)
