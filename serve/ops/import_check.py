"""Own TorchRec models end to end through the real service: fit on 2 gloo ranks, import,
serve, and compare the HTTP answers with TorchRec's own quantized forward.

    python -m serve.ops.import_check                       # all four models (make import-check)
    python -m serve.ops.import_check --examples own_ranker --steps 5 --keep

Models: ``article_dcn``, ``dlrm_v2`` (rows capped by ``DLRMV2_MAX_ROWS``, default 20000),
``own_ranker`` (``examples/<name>/model.py:make_model``) and ``builtin`` (our DLRM, profile
``tiny``, trained by the pipeline's own 2-rank training; a generated factory module over
``serve.model.dlrm.build_dlrm`` imports its checkpoint).

For each model:

1. **fit**: ``python -m serve.model.fit --world-size 2 --steps N`` (2 real gloo ranks under
   ``DistributedModelParallel``; a ``torch.distributed.checkpoint`` directory). ``builtin``:
   ``python -m serve.model.pipeline --profile tiny`` into the temp folder (its
   ``PipelineConfig.checkpoint_dir``; it trains its profile's epoch, ``--steps`` does not
   apply);
2. **import**: ``python -m serve.model.importer`` into a temporary model store (the
   importer's own ``max_abs_diff`` and the wall time are recorded);
3. **serve**: one real service (TorchServe + sidecar, ``serve.ops.launcher``) on free
   127.0.0.1 ports over that store; each version is declared in turn with ``PUT /state``
   until ``converged`` and ``observed.model.version`` is it. A version that does not
   converge fails its own row, and the service is restarted for the next one;
4. **schema**: ``GET /state``'s ``observed.model.schema`` must equal the importer's report
   (names, tables, rows, dims, pooling, max_ids), and the report must describe the model
   loaded from the checkpoint (:func:`serve.model.export.model_schema`);
5. **predictions**: a fixed batch (``--batch`` instances from the schema: multi-hot up to
   each feature's max_ids, empty lists, ids spanning each table up to its last row) in JSON
   rows form to ``POST /predictions/dlrm``, against ``torch.sigmoid`` of TorchRec's
   ``quantize_inference_model(model)`` forward on the same inputs, ``model`` being the
   factory's model loaded from the same checkpoint; max |difference| <= ``--tolerance``;
6. **bad requests**: an unknown feature, a missing feature, more ids than max_ids, a wrong
   dense count: each must be a 400 whose JSON message names the feature (or the dense
   count). No request of the run may get a 5xx;
7. **switch under load** (once, ``own_ranker``): it is fitted twice (seeds 0 and 1) and
   imported as two versions of the same schema; while ``--clients`` threads post the fixed
   batch continuously, ``PUT /state`` switches from one to the other. No request may fail;
   after the switch the answers come from the new version and equal its own reference.

Prints a table and writes JSON (``--out``); exits 1 when a check fails, 2 on a bad option.
The service is stopped and the temporary folder removed at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from serve import settings
from serve.common.validate import int_at_least
from serve.errors import ConfigError, ServeError, UpstreamUnavailable

__all__ = [
    "CASES",
    "DEFAULT_MODELS",
    "BadRequest",
    "CheckConfig",
    "CheckReport",
    "FitResult",
    "FixedBatch",
    "ImportResult",
    "ModelCase",
    "ModelRow",
    "Service",
    "StepFailed",
    "SwitchResult",
    "bad_requests",
    "check_model",
    "expected_schema",
    "fit_model",
    "fixed_batch",
    "format_table",
    "import_version",
    "instances_body",
    "main",
    "reference_probabilities",
    "run_check",
    "schema_differences",
    "switch_under_load",
]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("bench/results/import_check.json")
#: Largest |HTTP - TorchRec| probability accepted: the importer's own bar.
DEFAULT_TOLERANCE = 1e-6
#: The model fitted twice (two seeds, two versions of one schema) for the switch under load.
SWITCH_MODEL = "own_ranker"
SWITCH_SEEDS = (0, 1)
BUILTIN_PROFILE = "tiny"
_UNKNOWN_FEATURE = "zz_not_a_feature"
# Batching and workers every version is declared with: 1 worker with 1 torch thread, so
# the service, the reference forward and the load clients share 2 cores without
# oversubscription; batch 2 / 2 ms are the archives' own defaults.
_BATCH_SIZE, _DELAY_MS = 2, 2
_ERROR_LINE = re.compile(r"\b([A-Za-z]*Error: .+)$")

Say = Callable[[str], None]


# ----------------------------------------------------------------------------- models

@dataclass(frozen=True)
class ModelCase:
    """One model the check runs.

    Attributes:
        name: the ``--examples`` name.
        stem: the version names' prefix (``<stem>-s<seed>``; versions use '-', not '_').
        factory: ``FILE.py:FUNCTION`` relative to the repository; None for ``builtin``
            (its factory module is generated, see :func:`fit_model`).
        fit_args: extra ``serve.model.fit`` flags (DLRM-v2's wide layers need a smaller
            dense learning rate).
    """

    name: str
    stem: str
    factory: str | None
    fit_args: tuple[str, ...] = ()

    def version(self, seed: int) -> str:
        return f"{self.stem}-s{seed}"


CASES: dict[str, ModelCase] = {c.name: c for c in (
    ModelCase("article_dcn", "article-dcn", "examples/article_dcn/model.py:make_model"),
    ModelCase("dlrm_v2", "dlrm-v2", "examples/dlrm_v2/model.py:make_model",
              ("--dense-lr", "0.001")),
    ModelCase("own_ranker", "own-ranker", "examples/own_ranker/model.py:make_model"),
    ModelCase("builtin", "builtin", None),
)}
DEFAULT_MODELS = tuple(CASES)


@dataclass(frozen=True)
class CheckConfig:
    """One run of the check; see the module docstring.

    Attributes:
        workdir: where checkpoints, the model store and the service's files go (the CLI
            makes a temporary folder and removes it unless ``--keep``).
        models: names of :data:`CASES`, in the order they are checked.
        steps: training steps per fit (not ``builtin``: the pipeline trains its epoch).
        batch: instances in the fixed batch (>= 2: one carries every feature's max ids,
            one only empty lists).
        seed: seed of the fixed batch (the importer checks with seed 0: another batch).
        clients: closed-loop client threads during the switch under load.
        workers: TorchServe workers each version is declared with.
        converge_timeout_s: longest wait for a version to serve (start or ``PUT /state``).
        step_timeout_s: longest run of one fit, pipeline or import subprocess.
    """

    workdir: Path
    models: tuple[str, ...] = DEFAULT_MODELS
    steps: int = 20
    batch: int = 64
    seed: int = 1
    tolerance: float = DEFAULT_TOLERANCE
    clients: int = 3
    workers: int = 1
    converge_timeout_s: float = 240.0
    step_timeout_s: float = 1800.0
    switch_seeds: tuple[int, int] = SWITCH_SEEDS

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in CASES]
        if unknown or not self.models:
            raise ConfigError(f"--examples {','.join(self.models)!r}: {unknown or 'none'} "
                              f"unknown; pick from {','.join(CASES)}")
        if len(set(self.models)) != len(self.models):
            raise ConfigError(f"--examples {','.join(self.models)!r} names a model twice")
        for name, lo in (("steps", 1), ("batch", 2), ("clients", 1), ("workers", 1)):
            int_at_least(f"--{name}", getattr(self, name), lo)
        if not (isinstance(self.tolerance, float) and self.tolerance >= 0):
            raise ConfigError(f"--tolerance {self.tolerance!r} must be a float >= 0")
        for name in ("converge_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} {getattr(self, name)!r} must be > 0")
        if len(self.switch_seeds) != 2 or self.switch_seeds[0] == self.switch_seeds[1]:
            raise ConfigError(f"switch_seeds {self.switch_seeds!r} must be two different seeds")


class StepFailed(ServeError):
    """A step of one model failed; the message says which and why (with a log excerpt)."""


# ----------------------------------------------------------------------------- results

@dataclass
class FitResult:
    """A trained checkpoint and the factory that imports it."""

    factory: str
    checkpoint: Path
    seed: int
    seconds: float
    world_size: int = 2
    final_loss: float | None = None


@dataclass
class ImportResult:
    """One imported version: the importer's JSON line and its report."""

    version: str
    factory: str
    checkpoint: Path
    max_abs_diff: float
    seconds: float
    report: dict[str, Any] = field(repr=False)


@dataclass
class BadRequest:
    """One malformed request and how the service answered it."""

    case: str
    must_name: tuple[str, ...]   # every one must appear in the message
    status: int
    message: str
    names_it: bool

    @property
    def ok(self) -> bool:
        return self.status == 400 and self.names_it


@dataclass
class ModelRow:
    """Everything checked for one model; ``errors`` empty means it passed."""

    model: str
    version: str | None = None
    dense_kind: str | None = None
    dense: int | None = None
    tables: int | None = None
    features: int | None = None
    fit_seconds: float | None = None
    final_loss: float | None = None
    import_seconds: float | None = None
    import_max_abs_diff: float | None = None
    converge_seconds: float | None = None
    schema_match: bool | None = None
    http_max_abs_diff: float | None = None
    http_instances: int | None = None
    http_ids: int | None = None
    bad_requests: list[BadRequest] = field(default_factory=list)
    http_requests: int = 0
    http_5xx: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def bad_ok(self) -> int:
        return sum(b.ok for b in self.bad_requests)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bad_requests"] = [{**dataclasses.asdict(b), "ok": b.ok} for b in self.bad_requests]
        d["ok"] = self.ok
        return d


@dataclass
class SwitchResult:
    """The version switch under load."""

    from_version: str
    to_version: str
    clients: int
    served: int = 0
    failed: int = 0
    served_during_switch: int = 0
    http_5xx: int = 0
    converge_seconds: float | None = None
    versions: dict[str, int] = field(default_factory=dict)
    versions_after: dict[str, int] = field(default_factory=dict)
    after_max_abs_diff: float | None = None
    answers_changed: bool | None = None
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


@dataclass
class CheckReport:
    """The whole run: a row per model and the switch (None: ``own_ranker`` not selected)."""

    rows: list[ModelRow]
    switch: SwitchResult | None
    seconds: float = 0.0
    switch_errors: list[str] = field(default_factory=list)
    http_requests: int = 0    # every request of the run, the switch's load included
    http_5xx: int = 0

    @property
    def ok(self) -> bool:
        return (all(r.ok for r in self.rows) and not self.switch_errors and not self.http_5xx
                and (self.switch is None or self.switch.ok))

    def to_dict(self, config: CheckConfig | None = None) -> dict[str, Any]:
        return {
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": None if config is None else {
                k: (os.fspath(v) if isinstance(v, Path) else v)
                for k, v in dataclasses.asdict(config).items()},
            "models": [r.to_dict() for r in self.rows],
            "switch": None if self.switch is None else self.switch.to_dict(),
            "switch_errors": self.switch_errors,
            "http_requests": self.http_requests,
            "http_5xx": self.http_5xx,
            "seconds": round(self.seconds, 1),
            "ok": self.ok,
        }


# ----------------------------------------------------------------------------- subprocesses

def _run(cmd: Sequence[str], log_file: Path, what: str, timeout_s: float,
         env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run ``cmd`` from the repository root, stdout+stderr into ``log_file``; (its stdout's
    last line, seconds). ``StepFailed`` with the log's tail when it fails."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_file, "w") as out:
        try:
            proc = subprocess.run(list(cmd), cwd=REPO, stdout=subprocess.PIPE, stderr=out,
                                  text=True, timeout=timeout_s, check=False,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        except subprocess.TimeoutExpired:
            raise StepFailed(f"{what} ran longer than {timeout_s:.0f} s; see {log_file}") from None
        out.write(proc.stdout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = " | ".join(log_file.read_text().strip().splitlines()[-4:])
        raise StepFailed(f"{what} exited with {proc.returncode}: {tail[-800:]} (log {log_file})")
    lines = proc.stdout.strip().splitlines()
    return (lines[-1] if lines else ""), seconds


def _builtin_factory(folder: Path, profile: str = BUILTIN_PROFILE) -> str:
    """Write a factory module for our DLRM (``build_dlrm(get_profile(profile))``, N = 13
    dense features); its ``FILE.py:make_model``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "builtin_factory.py"
    path.write_text(
        f'"""Generated by serve.ops.import_check: the built-in DLRM (profile {profile}) as an '
        'import factory."""\n'
        "from serve.model.dlrm import build_dlrm\n"
        "from serve.profiles import NUM_DENSE, get_profile\n\n"
        '__all__ = ["NUM_DENSE", "make_model"]\n\n\n'
        "def make_model():\n"
        f"    return build_dlrm(get_profile({profile!r}))\n")
    return f"{path}:make_model"


def fit_model(case: ModelCase, out_dir: Path, *, steps: int, seed: int = 0,
              timeout_s: float = 1800.0) -> FitResult:
    """Train ``case`` over 2 gloo ranks into a DCP checkpoint under ``out_dir``.

    Examples: ``serve.model.fit`` writes ``out_dir/ckpt``. ``builtin``: the pipeline
    (``serve.model.pipeline --profile tiny``) builds into ``out_dir`` (its own small model
    store inside it) and its ``PipelineConfig.checkpoint_dir`` is the checkpoint; a factory
    module over ``build_dlrm`` is written beside it.

    Raises:
        StepFailed: the training exited non-zero or ran past ``timeout_s``.
    """
    py = sys.executable
    if case.factory is None:
        from serve.model.pipeline import PipelineConfig
        from serve.profiles import get_profile

        factory = _builtin_factory(out_dir)
        workdir = out_dir / "pipeline"
        cmd = [py, "-m", "serve.model.pipeline", "--profile", BUILTIN_PROFILE, "--seed",
               str(seed), "--workdir", str(workdir), "--model-store", str(out_dir / "store"),
               "--version", case.version(seed), "--nproc", "2", "--backend", "gloo"]
        _, seconds = _run(cmd, out_dir / "pipeline.log", f"{case.name}: pipeline", timeout_s)
        ckpt = PipelineConfig(profile=get_profile(BUILTIN_PROFILE), workdir=workdir,
                              seed=seed).checkpoint_dir
        return FitResult(factory, ckpt, seed, seconds)
    factory = f"{REPO / case.factory}"
    ckpt = out_dir / "ckpt"
    cmd = [py, "-m", "serve.model.fit", "--factory", factory, "--out", str(ckpt),
           "--world-size", "2", "--steps", str(steps), "--seed", str(seed), *case.fit_args]
    last, seconds = _run(cmd, out_dir / "fit.log", f"{case.name}: fit", timeout_s)
    try:
        summary = json.loads(last)
    except ValueError:
        summary = {}
    return FitResult(factory, ckpt, seed, seconds, int(summary.get("world_size", 2)),
                     summary.get("final_loss"))


def import_version(factory: str, checkpoint: Path, version: str, store: Path, log_dir: Path,
                   timeout_s: float = 1800.0) -> ImportResult:
    """``python -m serve.model.importer`` into ``store``: its JSON line and report.

    Raises:
        StepFailed: the importer exited non-zero (its message is in the log tail).
    """
    cmd = [sys.executable, "-m", "serve.model.importer", "--factory", factory, "--checkpoint",
           str(checkpoint), "--version", version, "--model-store", str(store)]
    last, seconds = _run(cmd, log_dir / f"import-{version}.log", f"import of {version}",
                         timeout_s)
    try:
        out = json.loads(last)
        report = json.loads(Path(out["report"]).read_text())
    except (ValueError, KeyError, OSError) as e:
        raise StepFailed(f"import of {version}: its last line is not the JSON summary "
                         f"({type(e).__name__}: {e}): {last[:300]!r}") from None
    return ImportResult(version, factory, checkpoint, float(out["max_abs_diff"]), seconds,
                        report)


# ----------------------------------------------------------------------------- requests

def expected_schema(report: dict[str, Any]) -> dict[str, Any]:
    """The ``observed.model.schema`` a version's report promises (``ModelSchema.describe``)."""
    from serve.schema import ModelSchema

    return ModelSchema.from_dict(report["schema"]).describe()


def schema_differences(expected: dict[str, Any], observed: Any) -> list[str]:
    """What differs between two ``{"dense", "sparse": [...]}`` schemas, feature by feature;
    empty when they match."""
    if not isinstance(observed, dict):
        return [f"observed schema is {observed!r}, not an object"]
    diffs = []
    if observed.get("dense") != expected["dense"]:
        diffs.append(f"dense {observed.get('dense')!r} != {expected['dense']}")
    want, got = expected["sparse"], observed.get("sparse") or []
    if [f.get("name") for f in got] != [f["name"] for f in want]:
        diffs.append(f"features {[f.get('name') for f in got]} != {[f['name'] for f in want]}")
        return diffs
    for w, g in zip(want, got, strict=True):
        for key in ("table", "rows", "dim", "pooling", "max_ids"):
            if g.get(key) != w[key]:
                diffs.append(f"{w['name']}.{key} {g.get(key)!r} != {w[key]!r}")
    return diffs


def fixed_batch(schema: Any, batch: int, seed: int) -> tuple[Any, Any, Any]:
    """(dense (B, N) float32, values (nnz,) int64 feature-major, lengths (F, B) int32):
    :func:`serve.model.importer.generated_batch`: instance 0 carries each feature's
    max_ids, instance 1 only empty lists, the rest 1..max_ids; ids span each table and
    include its last row."""
    from serve.model.importer import generated_batch

    return generated_batch(schema, batch, seed)


def instances_body(schema: Any, dense: Any, values: Any, lengths: Any) -> dict[str, Any]:
    """The JSON rows form of a batch: ``{"instances": [{"dense": [...], "sparse":
    {feature: [ids]}}]}``. float32 values survive JSON exactly (repr of the float64)."""
    names = schema.feature_names
    b = int(dense.shape[0])
    per_feature: list[list[list[int]]] = []
    start = 0
    for f in range(len(names)):
        lens = [int(x) for x in lengths[f].tolist()]
        ids = values[start:start + sum(lens)].tolist()
        start += sum(lens)
        cuts = list(itertools.accumulate(lens, initial=0))
        per_feature.append([ids[cuts[i]:cuts[i + 1]] for i in range(b)])
    rows = dense.tolist()
    return {"instances": [{"dense": rows[i],
                           "sparse": {n: per_feature[f][i] for f, n in enumerate(names)}}
                          for i in range(b)]}


def reference_probabilities(factory: str, checkpoint: Path, report: dict[str, Any], dense: Any,
                            values: Any, lengths: Any) -> tuple[Any, list[str]]:
    """``torch.sigmoid`` of TorchRec's ``quantize_inference_model(model)`` forward, (B,),
    ``model`` being the factory's model loaded from ``checkpoint``; and the differences
    between the report's schema and the one read from that model (empty: it describes it).
    """
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from serve.model.export import model_schema, quantize_for_serving
    from serve.model.importer import load_checkpoint, load_factory
    from serve.schema import ModelSchema

    schema = ModelSchema.from_dict(report["schema"])
    fn, module = load_factory(factory)
    model = load_checkpoint(fn(), Path(checkpoint)).eval()
    num_dense = getattr(module, "NUM_DENSE", schema.dense)
    from_model = model_schema(model, num_dense,
                              table_dtypes={t.name: t.dtype for t in schema.tables},
                              max_ids={f.name: f.max_ids for f in schema.features})
    diffs = schema_differences(schema.describe(), from_model.describe())
    qmodel = quantize_for_serving(model, schema)  # quantize_inference_model, per-table dtype
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(schema.feature_names), values=values,
                                              lengths=lengths.reshape(-1))
    with torch.no_grad():
        probs = torch.sigmoid(qmodel(dense, kjt).float().reshape(-1))
    return probs, diffs


def bad_requests(schema: Any, good: dict[str, Any]
                 ) -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
    """(case, what its 400 message must name, body) for each malformed request of
    ``schema``; each body is ``[good, bad]``, so the error is in the second instance."""
    names = schema.feature_names
    tight = min(schema.features, key=lambda f: f.max_ids)

    def bad(sparse: dict[str, Any] | None = None, dense: list[float] | None = None
            ) -> dict[str, Any]:
        inst = {"dense": good["dense"] if dense is None else dense,
                "sparse": good["sparse"] if sparse is None else sparse}
        return {"instances": [good, inst]}

    return [
        ("unknown feature", (_UNKNOWN_FEATURE,),
         bad(sparse={**good["sparse"], _UNKNOWN_FEATURE: [0]})),
        ("missing feature", (names[-1],),
         bad(sparse={k: v for k, v in good["sparse"].items() if k != names[-1]})),
        (f"more ids than max_ids ({tight.max_ids + 1} > {tight.max_ids})", (tight.name,),
         bad(sparse={**good["sparse"], tight.name: [0] * (tight.max_ids + 1)})),
        (f"wrong dense count ({schema.dense + 1} for {schema.dense})",
         ("dense", str(schema.dense)), bad(dense=[*good["dense"], 0.0])),
    ]


def _message(body: Any) -> str:
    """An error body's message: its ``message`` (or ``error``) string, else every string
    value of the document joined."""
    if isinstance(body, dict):
        for key in ("message", "error"):
            if isinstance(body.get(key), str):
                return str(body[key])
    if isinstance(body, str):
        return body
    parts = body.values() if isinstance(body, dict) else body if isinstance(body, list) else []
    return " ".join(p for p in (_message(v) for v in parts) if p)


def _names(message: str, needles: Sequence[str]) -> bool:
    """Each of ``needles`` appears in ``message`` as a whole token (``8`` not inside ``18``)."""
    return all(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) is not None
               for n in needles)


# ----------------------------------------------------------------------------- the service

class Service:
    """The real service (TorchServe + sidecar) over ``store``, on free 127.0.0.1 ports.

    :meth:`serve` makes a version the served one: the first call starts the service with
    a state file declaring it (``serve.ops.launcher.start`` waits for a real predict),
    later ones ``PUT /state``; both wait until ``converged`` with ``observed.model.version``
    the version. A version that does not get there stops the service (a switch stuck on a
    broken version would hold up the next one); the next call starts a fresh one.
    Every request sent through :meth:`post` is counted, 5xx apart.
    """

    def __init__(self, root: Path, store: Path, *, workers: int = 1,
                 converge_timeout_s: float = 240.0, say: Say = print) -> None:
        self.root, self.store = root, store
        self.workers = workers
        self.converge_timeout_s = converge_timeout_s
        self.say = say
        self.starts = 0
        self.requests = 0
        self.http_5xx = 0
        self.cfg: Any = None
        self._svc: Any = None
        self._token = ""
        self._short: Path | None = None   # run dirs when root is too deep (see _config)
        self._http = httpx.Client(timeout=120, trust_env=False)

    # -- lifecycle ---------------------------------------------------------------------
    def desired(self, version: str) -> dict[str, Any]:
        return {"model": {"version": version},
                "batching": {"batch_size": _BATCH_SIZE, "max_batch_delay_ms": _DELAY_MS},
                "workers": self.workers, "rollout": None}

    def _config(self) -> Any:
        from serve.ops.launcher import LaunchConfig, free_port_settings

        run = self.root / f"service-{self.starts}"
        run_dir = run / "run"
        # TorchServe's workers listen on a unix socket in run_dir/torchserve/tmp: a path
        # over 107 bytes fails them ("AF_UNIX path too long"), so a deep root (pytest's
        # tmp_path) gets its run dir in a short temporary folder instead.
        if len(os.fsencode(run_dir / "torchserve" / "tmp" / ".ts.sock.65535")) > 100:
            if self._short is None:
                self._short = Path(tempfile.mkdtemp(prefix="ic-run-"))
            run_dir = self._short / str(self.starts)
        return LaunchConfig(
            **free_port_settings(), model_store=self.store,
            state_file=run / "state.yaml", run_dir=run_dir, log_dir=run / "logs",
            sidecar=True, ready_timeout_s=self.converge_timeout_s,
            extra_env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
            # The batching tuner would retune under the switch's load and change the
            # serving version behind the check's back.
            sidecar_env={settings.DLRM_AUTOTUNE.name: "0"})

    @property
    def running(self) -> bool:
        return self._svc is not None

    @property
    def predict_url(self) -> str:
        return f"{self.cfg.inference_url}/predictions/{self.cfg.model_name}"

    def client(self) -> Any:
        from serve.ops.state_client import StateClient

        return StateClient(self.cfg.sidecar_write_url, self._token)

    def serve(self, version: str) -> float:
        """Serve ``version``; seconds until converged on it.

        Raises:
            StepFailed: it did not serve within ``converge_timeout_s`` (the service is
                stopped; the message quotes ``GET /state`` and the workers' errors).
        """
        t0 = time.monotonic()
        try:
            if self._svc is None:
                self._start(version)
            else:
                r = self.client().put_state(self.desired(version))
                if r.status_code != 202:
                    raise StepFailed(f"PUT /state {version} answered {r.status_code}: "
                                     f"{r.text[:500]}")
            left = max(1.0, self.converge_timeout_s - (time.monotonic() - t0))
            st = self.client().wait_converged(self.desired(version), timeout_s=left)
            got = ((st.get("observed") or {}).get("model") or {}).get("version")
            if got != version:
                raise StepFailed(f"converged, but observed.model.version is {got!r}, not "
                                 f"{version!r}")
        except (ServeError, httpx.HTTPError) as e:
            why = self._diagnose(e)
            self.stop()
            raise StepFailed(f"version {version} did not serve within "
                             f"{self.converge_timeout_s:.0f} s: {why}") from None
        return time.monotonic() - t0

    def _start(self, version: str) -> None:
        from serve.ops.launcher import start
        from serve.state import Batching, DesiredState, ModelRef, write_state

        self.starts += 1
        self.cfg = self._config()
        write_state(self.cfg.path(self.cfg.state_file), DesiredState(
            model=ModelRef(version=version),
            batching=Batching(batch_size=_BATCH_SIZE, max_batch_delay_ms=_DELAY_MS),
            workers=self.workers))
        self.say(f"  starting TorchServe + sidecar (inference {self.cfg.inference_url}, "
                 f"sidecar {self.cfg.sidecar_url}, logs {self.cfg.path(self.cfg.log_dir)})")
        self._svc = start(self.cfg, say=lambda m: None)
        self._token = self.cfg.token_file.read_text().strip()

    def _diagnose(self, e: BaseException) -> str:
        """The error, ``GET /state``'s reason and last error, and the workers' first
        distinct exception lines (model_log.log)."""
        parts = [getattr(e, "message", None) or f"{type(e).__name__}: {e}"]
        if self.cfg is None:
            return parts[0]
        try:
            st = self.client().state()
            parts.append(f"state: phase {st.get('phase')!r}, reason {st.get('reason')!r}, "
                         f"last_error {st.get('last_error')!r}")
        except (httpx.HTTPError, ValueError):
            pass
        worker_errors = self.worker_errors()
        if worker_errors:
            parts.append("worker errors: " + " | ".join(worker_errors))
        return "; ".join(p[:1500] for p in parts)

    def worker_errors(self, limit: int = 2) -> list[str]:
        """The first ``limit`` distinct ``...Error: message`` lines of the workers' log."""
        if self.cfg is None:
            return []
        path = self.cfg.path(self.cfg.log_dir) / "model_log.log"
        seen: list[str] = []
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        for line in lines:
            m = _ERROR_LINE.search(line)
            if m and m.group(1)[:300] not in seen:
                seen.append(m.group(1)[:300])
                if len(seen) >= limit:
                    break
        return seen

    def stop(self) -> None:
        if self._svc is not None:
            self._svc.stop()
            self._svc = None

    def close(self) -> None:
        self.stop()
        self._http.close()
        if self._short is not None:
            shutil.rmtree(self._short, ignore_errors=True)
            self._short = None

    # -- requests ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return dict(self.client().state())

    def post(self, body: dict[str, Any]) -> httpx.Response:
        """POST a JSON body to the predict URL; counted (5xx apart)."""
        r = self._http.post(self.predict_url, content=json.dumps(body).encode(),
                            headers={"Content-Type": "application/json"})
        self.requests += 1
        if r.status_code >= 500:
            self.http_5xx += 1
        return r


# ----------------------------------------------------------------------------- checks

def _predictions(r: httpx.Response, n: int) -> list[float]:
    if r.status_code != 200:
        raise StepFailed(f"the fixed batch got HTTP {r.status_code}: {r.text[:500]}")
    try:
        preds = [float(p) for p in r.json()["predictions"]]
    except (ValueError, KeyError, TypeError) as e:
        raise StepFailed(f"the fixed batch's answer is malformed ({type(e).__name__}: {e}): "
                         f"{r.text[:300]}") from None
    if len(preds) != n:
        raise StepFailed(f"{len(preds)} predictions for {n} instances")
    return preds


def _max_abs_diff(preds: Sequence[float], ref: Any) -> float:
    diffs = [abs(p - float(q)) for p, q in zip(preds, ref.tolist(), strict=True)]
    return max(diffs) if diffs else 0.0


@dataclass
class FixedBatch:
    """The fixed batch of one version: its JSON body and TorchRec's probabilities (B,)."""

    body: dict[str, Any]
    ref: Any
    ids: int
    schema_diffs: list[str]


def _batch_for(imported: ImportResult, cfg: CheckConfig) -> FixedBatch:
    from serve.schema import ModelSchema

    schema = ModelSchema.from_dict(imported.report["schema"])
    dense, values, lengths = fixed_batch(schema, cfg.batch, cfg.seed)
    ref, diffs = reference_probabilities(imported.factory, imported.checkpoint, imported.report,
                                         dense, values, lengths)
    return FixedBatch(instances_body(schema, dense, values, lengths), ref, int(values.numel()),
                  diffs)


def check_model(svc: Service, imported: ImportResult, row: ModelRow, cfg: CheckConfig,
                say: Say = print) -> FixedBatch | None:
    """Steps 3-6 for one imported version; findings go to ``row`` (``errors`` lists what
    failed). Returns its fixed batch (for the switch), None when it did not serve."""
    v = imported.version
    before = (svc.requests, svc.http_5xx)
    say(f"[{row.model}] serve {v} (PUT /state, wait until converged)")
    try:
        row.converge_seconds = round(svc.serve(v), 1)
        say(f"[{row.model}] serving {v} after {row.converge_seconds} s")
        batch = _check_serving(svc, imported, row, cfg, say)
    except (ServeError, httpx.HTTPError) as e:
        row.errors.append(getattr(e, "message", None) or f"{type(e).__name__}: {e}")
        say(f"[{row.model}] FAILED: {row.errors[-1]}")
        batch = None
    row.http_requests = svc.requests - before[0]
    row.http_5xx = svc.http_5xx - before[1]
    if row.http_5xx:
        row.errors.append(f"{row.http_5xx} of {row.http_requests} requests got a 5xx")
    return batch


def _check_serving(svc: Service, imported: ImportResult, row: ModelRow, cfg: CheckConfig,
                   say: Say) -> FixedBatch:
    """Steps 4-6 on the version ``svc`` serves now."""
    from serve.ops.loadgen import VERSION_HEADER
    from serve.schema import ModelSchema

    v = imported.version
    observed = ((svc.state().get("observed") or {}).get("model") or {}).get("schema")
    diffs = schema_differences(expected_schema(imported.report), observed)
    row.schema_match = not diffs
    if diffs:
        row.errors.append(f"GET /state observed.model.schema differs from the report: {diffs}")

    batch = _batch_for(imported, cfg)
    if batch.schema_diffs:
        row.schema_match = False
        row.errors.append("the report's schema does not describe the checkpoint's model: "
                          f"{batch.schema_diffs}")
    row.http_instances, row.http_ids = cfg.batch, batch.ids
    r = svc.post(batch.body)
    try:
        preds = _predictions(r, cfg.batch)
        row.http_max_abs_diff = _max_abs_diff(preds, batch.ref)
        if row.http_max_abs_diff > cfg.tolerance:
            row.errors.append(f"HTTP predictions differ from TorchRec's quantized forward by "
                              f"{row.http_max_abs_diff:.3g} > {cfg.tolerance:g}")
        served_by = r.headers.get(VERSION_HEADER)
        if served_by != v:
            row.errors.append(f"the answer's {VERSION_HEADER} is {served_by!r}, not {v!r}")
    except StepFailed as e:
        row.errors.append(e.message)
    say(f"[{row.model}] {cfg.batch} instances ({batch.ids} ids) over HTTP: " + (
        f"max |HTTP - TorchRec quantized| = {row.http_max_abs_diff:.3g}"
        if row.http_max_abs_diff is not None else f"not compared: {row.errors[-1]}"))

    schema = ModelSchema.from_dict(imported.report["schema"])
    good = batch.body["instances"][2]  # a full instance (0: max ids, 1: empty lists)
    for case, needles, body in bad_requests(schema, good):
        r = svc.post(body)
        try:
            message = _message(r.json())
        except ValueError:
            message = f"(not JSON) {r.text}"
        b = BadRequest(case, needles, r.status_code, message[:500], _names(message, needles))
        row.bad_requests.append(b)
        if not b.ok:
            row.errors.append(f"bad request '{case}': HTTP {b.status}, message "
                              f"{b.message[:200]!r} (must be a 400 naming {list(needles)})")
    say(f"[{row.model}] bad requests: {row.bad_ok}/{len(row.bad_requests)} answered 400 "
        "naming the feature / dense count")
    return batch


def switch_under_load(svc: Service, to: ImportResult, body: dict[str, Any],
                      from_version: str, from_preds: Sequence[float] | None, cfg: CheckConfig,
                      say: Say = print) -> SwitchResult:
    """Step 7: ``cfg.clients`` threads post ``body`` continuously while ``PUT /state``
    switches ``from_version`` (serving) to ``to``. Then the new version's answers to the
    fixed batch must equal its own TorchRec reference (and differ from the old ones)."""
    from serve.ops.loadgen import BackgroundLoad

    res = SwitchResult(from_version, to.version, cfg.clients)
    n = len(body["instances"])
    with BackgroundLoad(svc.predict_url, [json.dumps(body).encode()], clients=cfg.clients,
                        timeout_s=120, expect_predictions=n) as load:
        try:
            load.wait_for(4 * cfg.clients, timeout_s=120)
            t0 = time.monotonic()
            res.converge_seconds = round(svc.serve(to.version), 1)
            converged_at = time.monotonic()
            load.wait_for(load.served + 4 * cfg.clients, timeout_s=120)
        except (StepFailed, UpstreamUnavailable) as e:
            res.errors.append(e.message)
            converged_at = t0 = math.inf
    answers = load.answers
    res.served, res.failed = load.served, load.failed
    res.failures = load.failures[:3]
    res.http_5xx = sum(1 for a in answers if a.status >= 500)
    res.served_during_switch = sum(1 for a in answers if a.ok and t0 <= a.t <= converged_at)
    res.versions = {str(k): c for k, c in load.versions().items()}
    res.versions_after = {str(k): c for k, c in load.versions(since=converged_at).items()}
    if res.failed:
        res.errors.append(f"{res.failed} requests failed during the switch: {res.failures}")
    if res.served == 0:
        res.errors.append("no request was served during the switch")
    if res.versions_after and set(res.versions_after) != {to.version}:
        res.errors.append(f"after converging, answers came from {res.versions_after}, not only "
                          f"{to.version}")
    if not res.errors:
        try:
            batch = _batch_for(to, cfg)
            preds = _predictions(svc.post(batch.body), n)
            res.after_max_abs_diff = _max_abs_diff(preds, batch.ref)
            if res.after_max_abs_diff > cfg.tolerance:
                res.errors.append(f"after the switch, {to.version}'s answers differ from its "
                                  f"TorchRec reference by {res.after_max_abs_diff:.3g}")
            if from_preds is not None:
                res.answers_changed = list(preds) != list(from_preds)
                if not res.answers_changed:
                    res.errors.append(f"{to.version} answers exactly as {from_version}: the "
                                      "switch changed nothing")
        except (ServeError, httpx.HTTPError) as e:
            res.errors.append(getattr(e, "message", None) or f"{type(e).__name__}: {e}")
    say(f"[switch] {from_version} -> {to.version} under {cfg.clients} clients: served "
        f"{res.served} ({res.served_during_switch} during the switch), failed {res.failed}, "
        f"converged in {_fmt(res.converge_seconds)} s")
    return res


# ----------------------------------------------------------------------------- the run

def _prepare(case: ModelCase, cfg: CheckConfig, store: Path, row: ModelRow, say: Say
             ) -> list[ImportResult]:
    """Fit and import ``case`` (twice, two seeds, for the switch model); the imports."""
    seeds = cfg.switch_seeds if case.name == SWITCH_MODEL else (0,)
    out: list[ImportResult] = []
    for seed in seeds:
        where = cfg.workdir / case.name / f"s{seed}"
        how = ("pipeline --profile tiny, 2 gloo ranks" if case.factory is None
               else f"2 gloo ranks, {cfg.steps} steps")
        say(f"[{case.name}] fit seed {seed} ({how})")
        fit = fit_model(case, where, steps=cfg.steps, seed=seed, timeout_s=cfg.step_timeout_s)
        loss = "" if fit.final_loss is None else f", final loss {fit.final_loss:.4f}"
        say(f"[{case.name}] trained in {fit.seconds:.1f} s{loss}: {fit.checkpoint}")
        imp = import_version(fit.factory, fit.checkpoint, case.version(seed), store, where,
                             timeout_s=cfg.step_timeout_s)
        say(f"[{case.name}] imported {imp.version} in {imp.seconds:.1f} s (importer's "
            f"max_abs_diff {imp.max_abs_diff:.3g}, dense part {imp.report.get('dense_kind')})")
        if not out:
            schema = imp.report["schema"]
            row.version, row.dense_kind = imp.version, imp.report.get("dense_kind")
            row.dense = schema["dense"]
            row.tables, row.features = len(schema["tables"]), len(schema["features"])
            row.fit_seconds, row.final_loss = round(fit.seconds, 1), fit.final_loss
            row.import_seconds = round(imp.seconds, 1)
            row.import_max_abs_diff = imp.max_abs_diff
        out.append(imp)
    return out


def run_check(cfg: CheckConfig, say: Say = print) -> CheckReport:
    """Steps 1-7 for ``cfg.models``; the service is stopped before returning."""
    t0 = time.monotonic()
    store = cfg.workdir / "model_store"
    rows = [ModelRow(m) for m in cfg.models]
    imports: dict[str, list[ImportResult]] = {}
    # Every fit and import first: training and the service would fight for 2 cores.
    for row in rows:
        try:
            imports[row.model] = _prepare(CASES[row.model], cfg, store, row, say)
        except (StepFailed, ConfigError) as e:
            row.errors.append(e.message)
            say(f"[{row.model}] FAILED: {e.message}")
    switch: SwitchResult | None = None
    switch_errors: list[str] = []
    svc = Service(cfg.workdir / "service", store, workers=cfg.workers,
                  converge_timeout_s=cfg.converge_timeout_s, say=say)
    try:
        for row in rows:
            if row.model not in imports:
                continue
            first = imports[row.model][0]
            batch = check_model(svc, first, row, cfg, say)
            if row.model != SWITCH_MODEL:
                continue
            if batch is None or not svc.running or len(imports[row.model]) < 2:
                switch_errors.append(f"the switch under load did not run: {first.version} "
                                     "never served")
                continue
            try:
                from_preds: list[float] | None = _predictions(svc.post(batch.body),
                                                              len(batch.body["instances"]))
            except (StepFailed, httpx.HTTPError):
                from_preds = None
            switch = switch_under_load(svc, imports[row.model][1], batch.body, first.version,
                                       from_preds, cfg, say)
    finally:
        svc.close()
    load = (switch.served + switch.failed, switch.http_5xx) if switch else (0, 0)
    return CheckReport(rows, switch, time.monotonic() - t0, switch_errors,
                       http_requests=svc.requests + load[0], http_5xx=svc.http_5xx + load[1])


# ----------------------------------------------------------------------------- output

def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def format_table(report: CheckReport) -> str:
    """The result table, one row per model, then the switch and every error."""
    head = ("model", "version", "dense kind", "tables", "features", "import s",
            "HTTP max|diff|", "bad 400/total", "5xx", "result")
    lines = []
    for r in report.rows:
        lines.append((r.model, r.version or "-", r.dense_kind or "-", _fmt(r.tables, "d"),
                      _fmt(r.features, "d"), _fmt(r.import_seconds, ".1f"),
                      _fmt(r.http_max_abs_diff, ".2e"),
                      f"{r.bad_ok}/{len(r.bad_requests)}", str(r.http_5xx),
                      "ok" if r.ok else "FAIL"))
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in lines]
    s = report.switch
    if s is not None:
        out.append(f"switch {s.from_version} -> {s.to_version} under {s.clients} clients: "
                   f"served {s.served} ({s.served_during_switch} during the switch), failed "
                   f"{s.failed}, 5xx {s.http_5xx}, converged in {_fmt(s.converge_seconds)} s; "
                   f"after: max |HTTP - TorchRec| {_fmt(s.after_max_abs_diff, '.2e')}"
                   f"{', answers changed' if s.answers_changed else ''}: "
                   f"{'ok' if s.ok else 'FAIL'}")
    for r in report.rows:
        out += [f"  {r.model}: {e}" for e in r.errors]
    if s is not None:
        out += [f"  switch: {e}" for e in s.errors]
    out += [f"  switch: {e}" for e in report.switch_errors]
    out.append(f"{'PASS' if report.ok else 'FAIL'} in {report.seconds:.0f} s: "
               f"{report.http_requests} HTTP requests, {report.http_5xx} 5xx")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m serve.ops.import_check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Own TorchRec models end to end: fit on 2 gloo ranks (a DCP checkpoint), import,\n"
            "serve through the real TorchServe + sidecar on 127.0.0.1, and check the HTTP\n"
            "answers against TorchRec's own quantized forward. Models: article_dcn, dlrm_v2\n"
            "(rows capped by DLRMV2_MAX_ROWS, default 20000), own_ranker (examples/), builtin\n"
            "(our DLRM, profile tiny, trained by serve.model.pipeline)."),
        epilog=(
            "per model:\n"
            "  1. fit: serve.model.fit --world-size 2 (builtin: serve.model.pipeline --profile tiny)\n"
            "  2. import: serve.model.importer into a temporary model store (its max_abs_diff, time)\n"
            "  3. serve: PUT /state, wait until converged on the version (one service for all;\n"
            "     restarted after a version that never serves)\n"
            "  4. GET /state observed.model.schema == the import report's schema\n"
            "  5. --batch instances (multi-hot up to max_ids, empty lists, each table's last row)\n"
            "     as JSON rows over HTTP vs torch.sigmoid(quantize_inference_model(model)(...)),\n"
            "     model loaded from the same checkpoint: max |diff| <= --tolerance\n"
            "  6. unknown feature, missing feature, too many ids, wrong dense count: each a 400\n"
            "     whose JSON message names it; no 5xx at all\n"
            "once (own_ranker, fitted with seeds 0 and 1, imported as two versions):\n"
            "  7. PUT /state switches versions while --clients threads post continuously:\n"
            "     0 failed requests; afterwards the new version's answers equal its reference\n"
            "\n"
            "Prints a table, writes --out (JSON). Exit status: 0 every check passed, 1 a check\n"
            "failed, 2 a bad option. Needs Java (make java); make import-check runs it."))
    ap.add_argument("--examples", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated models to check, in order (default: all, "
                         f"{','.join(DEFAULT_MODELS)}); the switch under load runs when "
                         f"{SWITCH_MODEL} is among them")
    ap.add_argument("--steps", type=int, default=20,
                    help="training steps of each fit (default 20; the builtin model trains "
                         "its pipeline's tiny-profile epoch instead). Few steps suffice: the "
                         "check is about exactness, not quality")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"the JSON report (default {DEFAULT_OUT})")
    ap.add_argument("--keep", action="store_true",
                    help="keep the temporary folder (checkpoints, model store, service logs) "
                         "and print where it is, to look into a failure")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="use this (new or empty) folder instead of a temporary one; kept")
    ap.add_argument("--batch", type=int, default=64,
                    help="instances in the fixed batch compared over HTTP (default 64, >= 2)")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="largest accepted |HTTP - TorchRec| probability (default 1e-6, the "
                         "importer's own bar)")
    ap.add_argument("--clients", type=int, default=3,
                    help="client threads posting continuously during the switch (default 3: "
                         "load on 2 cores without starving the switch itself)")
    ap.add_argument("--workers", type=int, default=1,
                    help="TorchServe workers each version is declared with (default 1, one "
                         "torch thread: the reference forward and the clients share the cores)")
    ap.add_argument("--converge-timeout", type=float, default=240.0,
                    help="seconds a version may take to serve after it is declared (default "
                         "240); past it the version fails and the service is restarted")
    ap.add_argument("--step-timeout", type=float, default=1800.0,
                    help="seconds one fit, pipeline or import may run (default 1800)")
    return ap


def main(argv: list[str] | None = None) -> int:
    from serve.common.clilog import setup_cli_logging

    args = _parser().parse_args(argv)
    setup_cli_logging()
    if args.workdir is not None:
        workdir, keep = args.workdir.resolve(), True
        workdir.mkdir(parents=True, exist_ok=True)
        if any(workdir.iterdir()):
            print(f"import_check: --workdir {workdir} is not empty; give a new or empty folder",
                  file=sys.stderr)
            return 2
    else:
        workdir, keep = Path(tempfile.mkdtemp(prefix="import-check-")), args.keep
    try:
        cfg = CheckConfig(workdir=workdir, models=tuple(m.strip() for m in
                                                        args.examples.split(",") if m.strip()),
                          steps=args.steps, batch=args.batch, tolerance=args.tolerance,
                          clients=args.clients, workers=args.workers,
                          converge_timeout_s=args.converge_timeout,
                          step_timeout_s=args.step_timeout)
    except ConfigError as e:
        print(f"import_check: {e.message}", file=sys.stderr)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        return 2
    print(f"import check of {', '.join(cfg.models)} in {workdir}", flush=True)
    try:
        report = run_check(cfg, say=lambda m: print(m, flush=True))
    finally:
        if keep:
            print(f"kept {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    out = args.out if args.out.is_absolute() else REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(cfg), indent=2) + "\n")
    print()
    print(format_table(report))
    print(f"wrote {out}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
