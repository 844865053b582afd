"""The ranking (context) form of a JSON predict request: features shared by every candidate
are sent once.

A ranking request scores the N candidates of one query (one user, one context). The
features every candidate shares go once into ``context``; the rest go with each candidate::

      {"context": {"dense": [13 numbers], "sparse": {"C1": [ids], ..., "C13": [ids]}},
       "candidates": [{"sparse": {"C14": [ids], ..., "C26": [ids]}}, ...N objects]}

or, columnar candidates (``lengths[b]`` ids of ``values`` belong to candidate b)::

      {"context": {...},
       "candidates": {"sparse": {"C14": {"values": [...], "lengths": [N ints]}, ...}}}

Rules (the split is the client's, per request):

* every sparse feature of the model goes in exactly one part: ``context.sparse`` (one id
  list, shared) or every candidate's ``sparse``;
* the dense vector goes whole into one part: ``context.dense`` (shared) or every
  candidate's ``dense`` (columnar: ``candidates.dense``, N rows);
* ``candidates`` holds 1 to ``max_instances`` candidates (the limit counts candidates);
  a context feature holds at most the feature's cap of ids, as an instance's does;
* the answer is ``{"predictions": [one per candidate, in order]}``, bit for bit what the
  same request sent as independent instances gets.

The decoded request (:class:`~serve.api.request.ParsedRequest`) keeps a context feature's
ids once, in candidate 0's cell, and names it in ``shared``: the runtime looks it up and
pools it once per request (:class:`serve.runtime.engine.SparseBatch`). A shared dense
vector is copied to every candidate: the dense part runs per candidate (see
docs/predict-api.md, "Ranking requests").
"""
from __future__ import annotations

from typing import Any

import numpy as np

from serve.api.config import HandlerConfig
from serve.api.json_body import (
    dense_matrix,
    fast_columnar,
    fast_rows,
    ids_array,
    parse_columnar,
    parse_rows,
)
from serve.api.request import ParsedRequest
from serve.api.spec import Spec, cap_rule, json_type, part_spec
from serve.errors import InvalidInput

__all__ = ["CONTEXT_KEYS", "assemble_context", "is_context_doc", "parse_context_doc",
           "ranking_request"]

#: The top-level keys of the context form.
CONTEXT_KEYS = frozenset(("context", "candidates"))
_CONTEXT_PART_KEYS = frozenset(("dense", "sparse"))
_SHAPE = ('{"context": {"dense": [...], "sparse": {"<feature>": [ids]}}, '
          '"candidates": [{"sparse": {...}}, ...]}')


def is_context_doc(doc: Any) -> bool:
    """Whether a decoded JSON body is meant as the context form (it has ``candidates``)."""
    return type(doc) is dict and "candidates" in doc


def parse_context_doc(doc: dict[str, Any], cfg: HandlerConfig, spec: Spec) -> ParsedRequest:
    """A decoded context-form body -> ParsedRequest: dense float32 (B, N) (a shared dense
    copied to each of the B candidates), lengths int32 (F, B), values int64 feature-major,
    ``shared`` = the context's features (ids in candidate 0's cell, length 0 elsewhere).

    Raises:
        PayloadTooLarge: more than ``cfg.max_instances`` candidates.
        InvalidInput: anything else wrong, naming the part, the feature and the rule.
    """
    if doc.keys() != CONTEXT_KEYS:
        extra, missing = sorted(set(doc) - CONTEXT_KEYS), sorted(CONTEXT_KEYS - set(doc))
        raise InvalidInput(f"body: {'missing keys ' + str(missing) if missing else ''}"
                           f"{'; ' if missing and extra else ''}"
                           f"{'unknown keys ' + str(extra) if extra else ''}; the ranking form "
                           f"has exactly \"context\" and \"candidates\": {_SHAPE}")
    ctx_sparse, ctx_dense = _context_part(doc["context"], spec)
    ctx_names = frozenset(ctx_sparse)
    cand_names = tuple(n for n in spec.names if n not in ctx_names)
    cand_dense = ctx_dense is None
    if not cand_names and not cand_dense:
        raise InvalidInput("context: holds every feature (dense and sparse), so all "
                           "candidates would be the same instance; send at least one feature "
                           "per candidate, or send one instance")
    part = part_spec(spec, cand_names, spec.nd if cand_dense else 0)
    cands = _candidates(doc["candidates"], cfg, spec, part, ctx_names, cand_dense)
    ctx_ids = {f: _context_ids(f, v, cfg, spec) for f, v in ctx_sparse.items()}
    return assemble_context(spec, cands, ctx_ids, ctx_dense)


def _context_part(ctx: Any, spec: Spec) -> tuple[dict[str, Any], np.ndarray | None]:
    """``context`` -> (its sparse features {name: raw ids}, its dense float32 (1, N) or
    None), the keys and feature names checked."""
    if not isinstance(ctx, dict):
        raise InvalidInput(f"context: is a JSON {json_type(ctx)}; expected an object "
                           '{"dense": [...], "sparse": {"<feature>": [ids]}} holding the '
                           "features every candidate shares")
    unknown = sorted(set(ctx) - _CONTEXT_PART_KEYS)
    if unknown:
        raise InvalidInput(f"context: unknown keys {unknown}; the context has \"dense\" "
                           "and/or \"sparse\"")
    sparse = ctx.get("sparse", {})
    if not isinstance(sparse, dict):
        raise InvalidInput(f"context.sparse: is a JSON {json_type(sparse)}; expected an "
                           "object {\"<feature>\": [ids], ...} of the features every "
                           "candidate shares")
    strangers = sorted(map(str, set(sparse) - spec.name_set))
    if strangers:
        raise InvalidInput(f"context.sparse: unknown features {', '.join(strangers)}; the "
                           f"model's sparse features are {spec.names_text}")
    dense = None
    if "dense" in ctx:
        dense = dense_matrix([ctx["dense"]], lambda _: "context.dense", spec.nd)
    return sparse, dense


def _context_ids(name: str, ids: Any, cfg: HandlerConfig, spec: Spec) -> np.ndarray:
    """One context feature's ids -> int64 (k,), within the feature's cap."""
    where = f"context.sparse.{name}"
    if not isinstance(ids, list):
        raise InvalidInput(f"{where}: is a JSON {json_type(ids)}; expected an array of ids, "
                           "e.g. [42] (one id list, shared by every candidate)")
    f = spec.names.index(name)
    caps = spec.caps(cfg.max_ids_per_feature)
    if len(ids) > int(caps.arr[f]):
        raise InvalidInput(f"{where}: has {len(ids)} ids; {cap_rule(caps, f, spec)}")
    return ids_array(ids, lambda k: f"{where}[{k}]")


def _candidates(cands: Any, cfg: HandlerConfig, spec: Spec, part: Spec,
                ctx_names: frozenset[str], with_dense: bool) -> ParsedRequest:
    """``candidates`` (rows or columnar) -> their ParsedRequest over ``part`` (the features
    not in the context; dense when ``with_dense``)."""
    def feature_error(path: str, got: set[str], _: Spec) -> None:
        _part_error(path, got, spec, part, ctx_names)

    if isinstance(cands, list):
        if not cands:
            raise InvalidInput(f"candidates: is empty; send 1 to {cfg.max_instances} "
                               "candidates")
        if not part.names:   # dense only per candidate
            return _dense_only(cands, cfg, spec)
        parsed = fast_rows(cands, cfg, part, with_dense)
        return parsed if parsed is not None else parse_rows(
            cands, cfg, part, root="candidates", with_dense=with_dense,
            feature_error=feature_error)
    if isinstance(cands, dict):
        return _columnar_candidates(cands, cfg, spec, part, with_dense, feature_error)
    raise InvalidInput(f"candidates: is a JSON {json_type(cands)}; expected an array of "
                       'objects {"sparse": {...}} (one per candidate) or a columnar object '
                       '{"sparse": {"<feature>": {"values": [...], "lengths": [...]}}}')


def _columnar_candidates(cands: dict[str, Any], cfg: HandlerConfig, spec: Spec, part: Spec,
                         with_dense: bool, feature_error: Any) -> ParsedRequest:
    want = frozenset(("dense", "sparse")) if with_dense else frozenset(("sparse",))
    if cands.keys() != want:
        dense_note = ("" if with_dense else
                      "; the dense vector is in the context, so candidates carry none")
        raise InvalidInput(f"candidates: has keys {sorted(map(str, cands))}; the columnar "
                           f"candidates have exactly {sorted(want)}{dense_note}")
    if not part.names:
        raise InvalidInput("candidates.sparse: every sparse feature is in the context; send "
                           'the candidates as rows [{"dense": [...]}, ...]')
    dense_rows = cands["dense"] if with_dense else None
    rows = None
    if dense_rows is None:   # B from the first feature's lengths (each is checked after)
        col = cands["sparse"].get(part.names[0]) if isinstance(cands["sparse"], dict) else None
        lens = col.get("lengths") if isinstance(col, dict) else None
        rows = len(lens) if isinstance(lens, list) else 1
    parsed = fast_columnar(dense_rows, cands["sparse"], cfg, part, rows)
    return parsed if parsed is not None else parse_columnar(
        dense_rows, cands["sparse"], cfg, part, root="candidates.", rows=rows,
        feature_error=feature_error)


def _dense_only(cands: list[Any], cfg: HandlerConfig, spec: Spec) -> ParsedRequest:
    """Candidates that carry only a dense vector (every sparse feature is in the context)."""
    if len(cands) > cfg.max_instances:
        parse_rows(cands, cfg, spec)   # raises the instance limit's 413
    for i, c in enumerate(cands):
        if not isinstance(c, dict) or c.keys() != {"dense"}:
            got = sorted(map(str, c)) if isinstance(c, dict) else json_type(c)
            raise InvalidInput(f"candidates[{i}]: has {got}; every sparse feature is in the "
                               'context, so each candidate is {"dense": [...]} only')
    dense = dense_matrix([c["dense"] for c in cands], lambda i: f"candidates[{i}].dense",
                          spec.nd)
    n = dense.shape[0]
    return ParsedRequest(dense, np.zeros((0, n), dtype=np.int32), np.zeros(0, dtype=np.int64))


def _part_error(path: str, got: set[str], spec: Spec, part: Spec,
                ctx_names: frozenset[str]) -> None:
    """A candidate's sparse keys are not the features left out of the context: name the
    features sent in both parts, in neither, and unknown ones."""
    both = [f for f in spec.names if f in got and f in ctx_names]
    neither = [f for f in part.names if f not in got]
    unknown = sorted(map(str, got - spec.name_set))
    parts = []
    if both:
        parts.append(f"features {', '.join(both)} are also in context.sparse (a feature goes "
                     "in one part only)")
    if neither:
        parts.append(f"features {', '.join(neither)} are in neither part (each sparse "
                     "feature goes in context.sparse or in every candidate)")
    if unknown:
        parts.append(f"unknown features {', '.join(unknown)}")
    raise InvalidInput(f"{path}: {'; '.join(parts)}; the candidates must carry exactly "
                       f"{part.names_text} (the model's features not in the context)")


def assemble_context(spec: Spec, cands: ParsedRequest, ctx_ids: dict[str, np.ndarray],
                     ctx_dense: np.ndarray | None) -> ParsedRequest:
    """Both parts of a ranking request, checked -> one ParsedRequest in the schema's
    feature order (every form's: JSON here, OIP's ``context.<name>`` inputs).

    Args:
        cands: the B candidates over the features not in ``ctx_ids``, in schema order
            (lengths (F_c, B); dense (B, N), or (B, 0) when ``ctx_dense`` is given).
        ctx_ids: context feature -> its int64 ids (k,); ctx_dense: float32 (1, N) or None.
    """
    b = cands.batch_size
    lengths = np.zeros((spec.nf, b), dtype=np.int32)
    cand_len = cands.lengths
    bounds = np.cumsum([0, *cand_len.sum(axis=1).tolist()]).tolist()
    chunks: list[np.ndarray] = []
    j = 0
    shared = []
    for f, name in enumerate(spec.names):
        ids = ctx_ids.get(name)
        if ids is None:
            lengths[f] = cand_len[j]
            chunks.append(cands.values[bounds[j]:bounds[j + 1]])
            j += 1
        else:
            lengths[f, 0] = ids.shape[0]
            chunks.append(ids)
            shared.append(f)
    values = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    dense = cands.dense if ctx_dense is None else np.repeat(ctx_dense, b, axis=0)
    if shared and b == 1:
        shared = []   # one candidate: its own ids, the instance form exactly
    return ParsedRequest(dense, lengths, values, tuple(shared))


def ranking_request(dense: np.ndarray, lengths: np.ndarray, values: np.ndarray,
                    context: frozenset[str] | set[str], *, dense_in_context: bool,
                    spec: Spec, form: str = "rows") -> dict[str, Any]:
    """The context-form body of B instances that share the ``context`` features (and the
    dense vector when ``dense_in_context``): what a client sends instead of the instances.

    Args:
        dense: (B, N) numbers; lengths: int (F, B); values: int (nnz,) feature-major, in
            ``spec.names`` order (the instance form's arrays).
        form: ``"rows"`` (a list of candidate objects) or ``"columnar"``.
    Raises:
        ValueError: a context feature (or the dense vector) differs between instances, an
            unknown feature, or an unknown form.
    """
    if form not in ("rows", "columnar"):
        raise ValueError(f"form {form!r} must be 'rows' or 'columnar'")
    unknown = sorted(set(context) - spec.name_set)
    if unknown:
        raise ValueError(f"context features {unknown} are not the model's ({spec.names_text})")
    b = lengths.shape[1]
    bounds = np.concatenate([[0], np.cumsum(lengths.reshape(-1))]).tolist()
    cells = [[values[bounds[f * b + s]:bounds[f * b + s + 1]].tolist() for s in range(b)]
             for f in range(spec.nf)]
    ctx: dict[str, Any] = {}
    if dense_in_context:
        if not (np.asarray(dense) == np.asarray(dense)[:1]).all():
            raise ValueError("dense_in_context: the instances' dense vectors differ")
        ctx["dense"] = np.asarray(dense)[0].tolist()
    sparse_ctx: dict[str, list[int]] = {}
    per_cand: dict[str, list[list[int]]] = {}
    for f, name in enumerate(spec.names):
        if name in context:
            if any(c != cells[f][0] for c in cells[f]):
                raise ValueError(f"context feature {name}: the instances' ids differ")
            sparse_ctx[name] = cells[f][0]
        else:
            per_cand[name] = cells[f]
    if sparse_ctx:
        ctx["sparse"] = sparse_ctx
    rows_dense = None if dense_in_context else np.asarray(dense).tolist()
    if form == "columnar":
        cands: Any = {"sparse": {n: {"values": [i for c in cs for i in c],
                                     "lengths": [len(c) for c in cs]}
                                 for n, cs in per_cand.items()}}
        if rows_dense is not None:
            cands["dense"] = rows_dense
    else:
        cands = [{"sparse": {n: cs[s] for n, cs in per_cand.items()}} for s in range(b)]
        if rows_dense is not None:
            for c, d in zip(cands, rows_dense, strict=True):
                c["dense"] = d
    return {"context": ctx, "candidates": cands}
