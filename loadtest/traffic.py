"""Realistic ranking traffic for the DLRM predict endpoint: request generator and checker.

A ranking request scores the candidates of one query: B instances, each with N = 13 dense
features and F = 26 sparse features (C1..C26, one or more ids each). MLPerf's DLRM-v2
server scenario aggregates 100-700 user-item pairs per query, about 270 on average; we
draw B from a lognormal-shaped law over the integers [min, max] whose mean is fitted to
the target exactly, and mix in a fraction of single-instance requests (a lone re-score).

Ids follow the same law as the training data (``serve.model.data``): Zipf(alpha) ranks per
feature, mapped to ids through the same fixed per-feature permutation, so the hot ids of
the load test are the hot ids the model (and the embedding cache) learnt. Dense features
follow the training distribution too: softplus of a standard normal, which is skewed and
non-negative like Criteo's log1p-transformed integer counts. The serving model applies
``id % rows``, so a profile that differs from the served one still gives valid requests.

Bodies are generated once into a :class:`RequestPool` of JSON bytes, so the load
generator's CPU goes to sending, not to building requests.

Two request forms: ``context`` (the default: one user, N candidates; the user's features,
the profile's ``context_features``, and the dense vector are sent once as the request's
context, the items' per candidate; :mod:`serve.api.context_body`) and ``instances``
(every candidate repeats every feature). Two body encodings of each (:mod:`serve.api`):

- ``row``:      ``{"instances": [{"dense": [13 floats], "sparse": {"C1": [ids], ...}}, ...]}``
  (context: ``{"context": {...}, "candidates": [{"sparse": {...}}, ...]}``)
- ``columnar``: ``{"dense": [[13 floats], ...], "sparse": {"C1": {"values": [...],
  "lengths": [...]}, ...}}`` (cheaper for the server to parse; context: columnar
  ``candidates``)

Answers are checked by :func:`check_response`: HTTP 200, a JSON object whose
``predictions`` holds exactly B numbers, each in [0, 1].
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import orjson

from serve.common.zipf import id_permutation, zeta_cdf, zipf_ranks
from serve.constants import REQUEST_FORMS
from serve.errors import ConfigError
from serve.profiles import NUM_DENSE, Profile

__all__ = [
    "BODY_FORMATS",
    "REQUEST_FORMS",
    "IdSampler",
    "InstancesDistribution",
    "PooledRequest",
    "RequestPool",
    "TrafficConfig",
    "check_response",
    "dense_features",
    "encode_body",
    "encode_context_body",
    "parse_features",
]

BODY_FORMATS = ("row", "columnar")
# Largest instance count the distribution accepts; the handler enforces its own
# max_instances (a request above it is a 4xx, which the checker reports as a failure).
_MAX_INSTANCES = 100_000
# Dense values are rounded to this many decimals: 1e-4 is far below what the model
# resolves and it keeps a 270-instance row body around 160 KiB instead of 230 KiB.
_DENSE_DECIMALS = 4


@dataclass(frozen=True)
class InstancesDistribution:
    """How many instances (candidates) a request carries.

    With probability ``single_fraction`` a request has 1 instance; otherwise B is drawn
    from the integers [``min``, ``max``] with P(B=k) proportional to a lognormal density
    exp(-(ln k - mu)^2 / (2 sigma^2)) / k, mu fitted (bisection) so E[B] == ``mean``.
    ``min == max`` gives a fixed size. The default is MLPerf DLRM-v2's server query:
    100-700 pairs, mean 270, plus 10% single-instance requests.
    """

    min: int = 100
    max: int = 700
    mean: float = 270.0
    single_fraction: float = 0.1
    sigma: float = 0.6
    _support: np.ndarray = field(init=False, repr=False, compare=False)
    _probs: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (1 <= self.min <= self.max <= _MAX_INSTANCES):
            raise ConfigError(
                f"instances range {self.min}-{self.max} is invalid: need 1 <= min <= max <= "
                f"{_MAX_INSTANCES}; give it as MIN-MAX[:MEAN], e.g. 100-700:270")
        if not (0.0 <= self.single_fraction <= 1.0):
            raise ConfigError(f"single-instance fraction {self.single_fraction} must be in "
                              "[0, 1] (e.g. 0.1 for 10% single-instance requests)")
        if not (self.sigma > 0 and math.isfinite(self.sigma)):
            raise ConfigError(f"instances sigma {self.sigma} must be a finite number > 0")
        support = np.arange(self.min, self.max + 1, dtype=np.float64)
        if self.min == self.max:
            if self.mean != self.min:
                raise ConfigError(f"instances mean {self.mean} must equal the fixed size "
                                  f"{self.min}; give just {self.min} or a range MIN-MAX:MEAN")
            probs = np.ones(1)
        else:
            if not (self.min < self.mean < self.max):
                raise ConfigError(
                    f"instances mean {self.mean} must lie strictly between min {self.min} and "
                    f"max {self.max}; e.g. 100-700:270")
            probs = _fit_lognormal_probs(support, self.mean, self.sigma)
        object.__setattr__(self, "_support", support.astype(np.int64))
        object.__setattr__(self, "_probs", probs)

    @classmethod
    def parse(cls, spec: str, single_fraction: float = 0.1) -> InstancesDistribution:
        """``"100-700:270"`` (range and mean), ``"1-64"`` (mean = midpoint) or ``"64"``."""
        text = spec.strip()
        try:
            rng_part, _, mean_part = text.partition(":")
            lo_s, dash, hi_s = rng_part.partition("-")
            lo = int(lo_s)
            hi = int(hi_s) if dash else lo
            mean = float(mean_part) if mean_part else (lo + hi) / 2.0 if hi > lo else float(lo)
        except ValueError:
            raise ConfigError(f"instances spec {spec!r} is not MIN-MAX[:MEAN] or N; "
                              "e.g. 100-700:270, 1-64 or 64") from None
        return cls(min=lo, max=hi, mean=mean, single_fraction=single_fraction)

    @property
    def expected_mean(self) -> float:
        """E[B] including the single-instance requests."""
        ranked = float(np.dot(self._support, self._probs))
        return self.single_fraction * 1.0 + (1.0 - self.single_fraction) * ranked

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n instance counts, int64 (n,)."""
        sizes = rng.choice(self._support, size=n, p=self._probs)
        singles = rng.random(n) < self.single_fraction
        sizes[singles] = 1
        return sizes

    def stratified(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n instance counts, int64 (n,), one per equal-probability stratum, shuffled.

        A small pool drawn independently can miss the law (a 256-body pool's mean is
        off by ~8 instances, one SE); one draw per 1/n quantile slice keeps the pool's
        single-instance share and mean within a stratum of the law's.
        """
        u = (np.arange(n) + rng.random(n)) / n
        sizes = np.ones(n, dtype=np.int64)
        ranked = u >= self.single_fraction
        if ranked.any():
            v = (u[ranked] - self.single_fraction) / (1.0 - self.single_fraction)
            cdf = np.cumsum(self._probs)
            idx = np.minimum(np.searchsorted(cdf, v * cdf[-1], side="right"), len(cdf) - 1)
            sizes[ranked] = self._support[idx]
        rng.shuffle(sizes)
        return sizes

    def spec(self) -> str:
        return f"{self.min}-{self.max}:{self.mean:g}"


def _fit_lognormal_probs(support: np.ndarray, mean: float, sigma: float) -> np.ndarray:
    """P(k) over ``support`` from a lognormal density, mu chosen so the mean is ``mean``.

    The mean is increasing in mu, so bisection on mu converges; log-space weights keep the
    extremes (mu far outside the support) free of overflow.
    """
    logk = np.log(support)

    def probs(mu: float) -> np.ndarray:
        logw = -((logk - mu) ** 2) / (2.0 * sigma * sigma) - logk
        w = np.exp(logw - logw.max())
        return w / w.sum()

    lo, hi = logk[0] - 40.0 * sigma, logk[-1] + 40.0 * sigma
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(np.dot(support, probs(mid))) < mean:
            lo = mid
        else:
            hi = mid
    return probs(0.5 * (lo + hi))


class IdSampler:
    """Zipf(alpha) ids per feature, the same law and id mapping as ``serve.model.data``.

    Rank k (0 = hottest) has P(k) proportional to (k+1)^-alpha over a table's rows; it is
    mapped to an id through the permutation ``np.random.default_rng([seed, 11, i])
    .permutation(rows)`` of feature i, which is how ``serve.model.data`` spreads hot ids over the
    table. ``permuted=False`` keeps id == rank (hot ids 0, 1, 2, ...).
    """

    def __init__(self, profile: Profile, alpha: float, seed: int | None = None,
                 permuted: bool = True) -> None:
        if not (alpha > 0 and math.isfinite(alpha)):
            raise ConfigError(f"zipf alpha {alpha} must be a finite number > 0 "
                              "(the training data uses the profile's, 1.05)")
        self.profile = profile
        self.alpha = alpha
        data_seed = profile.seed if seed is None else seed
        self._cdfs = [zeta_cdf(rows, alpha) for rows in profile.cardinalities]
        self._perms = ([id_permutation(data_seed, i, rows)
                        for i, rows in enumerate(profile.cardinalities)] if permuted else None)

    def ranks(self, rng: np.random.Generator, feature: int, n: int) -> np.ndarray:
        """n ranks of feature ``feature`` (0-based), int64 in [0, rows)."""
        rows = self.profile.cardinalities[feature]
        return zipf_ranks(rng, n, rows, self.alpha, self._cdfs[feature])

    def ids(self, rng: np.random.Generator, feature: int, n: int) -> np.ndarray:
        """n ids of feature ``feature``, int64 in [0, rows)."""
        r = self.ranks(rng, feature, n)
        return r if self._perms is None else self._perms[feature][r]


def dense_features(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, N) float64 dense features distributed like the training data.

    ``serve.model.data`` stores softplus(z), z ~ N(0, 1): non-negative and right-skewed like
    log1p of Criteo's integer counts. Rounded to 1e-4 to keep bodies small.
    """
    z = rng.standard_normal((n, NUM_DENSE))
    return np.round(np.logaddexp(0.0, z), _DENSE_DECIMALS)


def encode_body(dense: np.ndarray, ids: list[np.ndarray], lengths: np.ndarray,
                feature_names: tuple[str, ...], body_format: str) -> bytes:
    """One request body.

    Args:
        dense: (B, N) float.
        ids: F arrays; ids[j] holds feature j's ids for all B samples in order, sum of
            lengths[:, j] long (the KeyedJaggedTensor value layout).
        lengths: (B, F) int, ids per (sample, feature), >= 1.
        feature_names: the F names (C1..C26).
        body_format: ``"row"`` or ``"columnar"``.
    """
    if body_format == "columnar":
        sparse = {name: {"values": ids[j].tolist(), "lengths": lengths[:, j].tolist()}
                  for j, name in enumerate(feature_names)}
        return orjson.dumps({"dense": dense.tolist(), "sparse": sparse})
    if body_format != "row":
        raise ConfigError(f"body format {body_format!r} is unknown; use one of {BODY_FORMATS}")
    b = dense.shape[0]
    per_feature: list[list[list[int]]] = []
    for j in range(len(feature_names)):
        vals = ids[j].tolist()
        if (lengths[:, j] == 1).all():
            per_feature.append([[v] for v in vals])
        else:
            offs = np.concatenate([[0], np.cumsum(lengths[:, j])]).tolist()
            per_feature.append([vals[offs[i]:offs[i + 1]] for i in range(b)])
    dense_rows = dense.tolist()
    instances = [
        {"dense": dense_rows[i],
         "sparse": {name: per_feature[j][i] for j, name in enumerate(feature_names)}}
        for i in range(b)
    ]
    return orjson.dumps({"instances": instances})


def parse_features(text: str) -> tuple[str, ...] | None:
    """``"C1,C2"`` -> ("C1", "C2"); empty -> None (the profile's declaration)."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    return names or None


def encode_context_body(ctx_dense: np.ndarray, ctx_ids: dict[str, list[int]],
                        ids: list[np.ndarray], lengths: np.ndarray,
                        feature_names: tuple[str, ...], body_format: str) -> bytes:
    """One ranking request in the context form.

    Args:
        ctx_dense: (N,) the dense vector every candidate shares.
        ctx_ids: the context's features -> their one id list.
        ids, lengths, feature_names: the candidates' features as :func:`encode_body`
            takes them (F_c arrays; lengths (B, F_c)).
        body_format: ``"row"`` (candidate objects) or ``"columnar"``.
    """
    context = {"dense": ctx_dense.tolist(), "sparse": ctx_ids}
    if body_format == "columnar":
        cands: object = {"sparse": {name: {"values": ids[j].tolist(),
                                           "lengths": lengths[:, j].tolist()}
                                    for j, name in enumerate(feature_names)}}
    elif body_format == "row":
        b = lengths.shape[0]
        cols = []
        for j in range(len(feature_names)):
            offs = np.concatenate([[0], np.cumsum(lengths[:, j])]).tolist()
            vals = ids[j].tolist()
            cols.append([vals[offs[i]:offs[i + 1]] for i in range(b)])
        cands = [{"sparse": {name: cols[j][i] for j, name in enumerate(feature_names)}}
                 for i in range(b)]
    else:
        raise ConfigError(f"body format {body_format!r} is unknown; use one of {BODY_FORMATS}")
    return orjson.dumps({"context": context, "candidates": cands})


@dataclass(frozen=True)
class TrafficConfig:
    """What the load generator sends.

    Attributes:
        profile: gives the F cardinalities and multi-hot length (use the served one).
        instances: instances-per-request law.
        zipf_alpha: id skew (the training data uses the profile's, 1.05).
        body_format: ``row`` or ``columnar``.
        form: ``context`` (default: the user's features and dense sent once per request)
            or ``instances`` (every candidate carries all features).
        context_features: the user-side features sent as the context (None: the
            profile's ``context_features``).
        pool_size: distinct bodies generated up front; requests pick one at random.
        seed: seed of the pool (fixed so runs are comparable).
        data_seed: seed of the id permutation; must be the training data's to hit the
            same hot ids (default: the profile's seed, which ``serve.model.data`` uses).
    """

    profile: Profile
    instances: InstancesDistribution = InstancesDistribution()
    zipf_alpha: float = 1.05
    body_format: str = "row"
    form: str = "context"
    context_features: tuple[str, ...] | None = None
    # 256 bodies of ~100 KiB: ~25 MiB, built in about a second, and enough draws that the
    # pool's mix of sizes (and its ~10% singles) matches the law closely.
    pool_size: int = 256
    seed: int = 0
    data_seed: int | None = None

    @property
    def shared_features(self) -> tuple[str, ...]:
        """The features the context form sends once (the profile's unless given)."""
        return (self.context_features if self.context_features is not None
                else self.profile.context_features)

    def __post_init__(self) -> None:
        if self.body_format not in BODY_FORMATS:
            raise ConfigError(f"body format {self.body_format!r} is unknown; "
                              f"use one of {', '.join(BODY_FORMATS)}")
        if self.form not in REQUEST_FORMS:
            raise ConfigError(f"request form {self.form!r} is unknown; use one of "
                              f"{', '.join(REQUEST_FORMS)}")
        stray = sorted(set(self.context_features or ()) - set(self.profile.feature_names))
        if stray:
            raise ConfigError(f"context features {stray} are not the model's features "
                              f"({', '.join(self.profile.feature_names)})")
        if not (1 <= self.pool_size <= 10_000):
            raise ConfigError(f"pool size {self.pool_size} must be in [1, 10000] bodies")
        if not (self.zipf_alpha > 0 and math.isfinite(self.zipf_alpha)):
            raise ConfigError(f"zipf alpha {self.zipf_alpha} must be a finite number > 0")


@dataclass(frozen=True)
class PooledRequest:
    """One pre-encoded body and the number of instances (B) it carries."""

    body: bytes
    instances: int


class RequestPool:
    """Pre-generated request bodies; :meth:`pick` returns one at random (cheap)."""

    def __init__(self, config: TrafficConfig) -> None:
        self.config = config
        p = config.profile
        rng = np.random.default_rng([config.seed, 2024])
        sampler = IdSampler(p, config.zipf_alpha, config.data_seed)
        sizes = config.instances.stratified(rng, config.pool_size)
        m = p.max_ids_per_feature
        self.requests: list[PooledRequest] = []
        ctx = set(config.shared_features) if config.form == "context" else set()
        for b in sizes.tolist():
            if ctx:
                body = self._context_body(rng, sampler, b, ctx)
            else:
                dense = dense_features(rng, b)
                lengths = (rng.integers(1, m + 1, size=(b, p.num_sparse)) if m > 1
                           else np.ones((b, p.num_sparse), dtype=np.int64))
                ids = [sampler.ids(rng, j, int(lengths[:, j].sum()))
                       for j in range(p.num_sparse)]
                body = encode_body(dense, ids, lengths, p.feature_names, config.body_format)
            self.requests.append(PooledRequest(body, b))
        self._pick_rng = random.Random(config.seed)

    def _context_body(self, rng: np.random.Generator, sampler: IdSampler, b: int,
                      ctx: set[str]) -> bytes:
        """One user (the context features' ids and the dense vector, drawn once) and b
        candidates (the other features' ids, drawn per candidate)."""
        p, m = self.config.profile, self.config.profile.max_ids_per_feature
        names = p.feature_names
        ctx_ids = {}
        for j, name in enumerate(names):
            if name in ctx:
                k = int(rng.integers(1, m + 1)) if m > 1 else 1
                ctx_ids[name] = sampler.ids(rng, j, k).tolist()
        cand = [j for j, name in enumerate(names) if name not in ctx]
        lengths = (rng.integers(1, m + 1, size=(b, len(cand))) if m > 1
                   else np.ones((b, len(cand)), dtype=np.int64))
        ids = [sampler.ids(rng, j, int(lengths[:, k].sum())) for k, j in enumerate(cand)]
        return encode_context_body(dense_features(rng, 1)[0], ctx_ids, ids, lengths,
                                   tuple(names[j] for j in cand), self.config.body_format)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def mean_instances(self) -> float:
        return sum(r.instances for r in self.requests) / len(self.requests)

    @property
    def total_bytes(self) -> int:
        return sum(len(r.body) for r in self.requests)

    def pick(self) -> PooledRequest:
        return self.requests[self._pick_rng.randrange(len(self.requests))]


def check_response(status: int, content: bytes | None, instances: int) -> str | None:
    """Why an answer is wrong, or None when it is right.

    Right means: HTTP 200, a JSON object whose ``predictions`` is a list of exactly
    ``instances`` numbers, each in [0, 1] (NaN and booleans are wrong).
    """
    snippet = (content or b"")[:300].decode("utf-8", "replace")
    if status != 200:
        return f"HTTP {status}: {snippet}" if status else f"no HTTP answer: {snippet}"
    try:
        doc = orjson.loads(content or b"")
    except orjson.JSONDecodeError:
        return f"response is not JSON: {snippet!r}"
    preds = doc.get("predictions") if isinstance(doc, dict) else None
    if not isinstance(preds, list):
        return f"response has no 'predictions' list: {snippet!r}"
    if len(preds) != instances:
        return f"expected {instances} predictions, got {len(preds)}"
    for i, v in enumerate(preds):
        if type(v) is not float and type(v) is not int:
            return f"predictions[{i}] = {v!r} is not a number"
        if not (0.0 <= v <= 1.0):
            return f"predictions[{i}] = {v!r} is outside [0, 1]"
    return None
