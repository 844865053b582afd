"""What :mod:`serve.ops.import_check` sends and what the answers must be: the schema a
report promises, the fixed batch in JSON rows form, TorchRec's reference probabilities and
the malformed requests whose 400 must name the feature."""
from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "bad_requests",
    "error_message",
    "expected_schema",
    "fixed_batch",
    "instances_body",
    "names_each",
    "reference_probabilities",
    "schema_differences",
]

_UNKNOWN_FEATURE = "zz_not_a_feature"

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


def error_message(body: Any) -> str:
    """An error body's message: its ``message`` (or ``error``) string, else every string
    value of the document joined."""
    if isinstance(body, dict):
        for key in ("message", "error"):
            if isinstance(body.get(key), str):
                return str(body[key])
    if isinstance(body, str):
        return body
    parts = body.values() if isinstance(body, dict) else body if isinstance(body, list) else []
    return " ".join(p for p in (error_message(v) for v in parts) if p)


def names_each(message: str, needles: Sequence[str]) -> bool:
    """Each of ``needles`` appears in ``message`` as a whole token (``8`` not inside ``18``)."""
    return all(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", message) is not None
               for n in needles)
