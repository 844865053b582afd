"""``make oip-check``: a stock KServe v2 client (tritonclient) against a running ``make up``.

Runs in its own venv (``.oipenv``: tritonclient[http] pinned, numpy) and imports nothing
of this repository, as a client would. It reads the Open Inference Protocol's base URL from
the sidecar's ``GET /state`` (``endpoints.oip_url``) and the served schema
(``observed.model.schema``), then:

1. ``is_server_live``, ``is_server_ready``, ``is_model_ready("dlrm")`` and the model's
   metadata (its inputs must be the schema's);
2. ``infer`` with binary tensors (and a binary output) for 512 instances, a third of the
   features multi-hot (``<feature>.lengths``), seeded; then the same as JSON tensors;
3. the same instances through our own API (``POST /predictions/dlrm``, binary columnar
   form), and ``numpy.array_equal`` of the FP32 probability vectors.

Prints a table and writes ``bench/results/oip_check.json``; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

OUT = Path(__file__).resolve().parents[1] / "bench" / "results" / "oip_check.json"


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _instances(schema: dict, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dense float32 (n, N), lengths int32 (F, n), values int64 (nnz,) feature-major: one id
    per instance in most features; every third feature (whose max_ids allows it) 0..3 ids."""
    rng = np.random.default_rng(seed)
    sparse = schema["sparse"]
    dense = rng.random((n, int(schema["dense"])), dtype=np.float32)
    lengths = np.ones((len(sparse), n), dtype=np.int32)
    for f, feat in enumerate(sparse):
        if f % 3 == 2 and int(feat["max_ids"]) > 1:
            lengths[f] = rng.integers(0, min(4, int(feat["max_ids"])) + 1, size=n)
    values = rng.integers(0, 2**31, size=int(lengths.sum()), dtype=np.int64)
    return dense, lengths, values


def _ours(url: str, dense: np.ndarray, lengths: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Our API's binary columnar form (README, "Predict API"), built by hand."""
    b, nd = dense.shape
    body = (b"DLRM" + np.array([1, b, lengths.shape[0], nd], "<u4").tobytes()
            + dense.astype("<f4").tobytes() + lengths.astype("<i4").tobytes()
            + values.astype("<i8").tobytes())
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/x-dlrm-columnar"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return np.asarray(json.loads(r.read())["predictions"], dtype=np.float64).astype(np.float32)


def _oip(client: httpclient.InferenceServerClient, model: str, schema: dict,
         dense: np.ndarray, lengths: np.ndarray, values: np.ndarray,
         binary: bool = True) -> np.ndarray:
    inputs = []

    def add(name: str, arr: np.ndarray, datatype: str) -> None:
        t = httpclient.InferInput(name, list(arr.shape), datatype)
        t.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(t)

    add("dense", dense, "FP32")
    ends = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))])
    for f, feat in enumerate(schema["sparse"]):
        add(feat["name"], values[ends[f]:ends[f + 1]], "INT64")
        if not (lengths[f] == 1).all():
            add(feat["name"] + ".lengths", lengths[f], "INT32")
    out = [httpclient.InferRequestedOutput("probabilities", binary_data=binary)]
    result = client.infer(model, inputs, outputs=out)
    return result.as_numpy("probabilities")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sidecar", default="http://127.0.0.1:8090",
                    help="the sidecar's public URL (GET /state)")
    ap.add_argument("--predict-url", default="http://127.0.0.1:8080/predictions/dlrm",
                    help="our own API's predictions URL")
    ap.add_argument("--model", default="dlrm")
    ap.add_argument("--instances", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    state = _get_json(f"{args.sidecar}/state")
    oip_url = (state.get("endpoints") or {}).get("oip_url")
    model = state["observed"]["model"] or {}
    schema = model.get("schema")
    if not oip_url or not schema:
        print(f"GET {args.sidecar}/state has no endpoints.oip_url ({oip_url!r}) or no "
              f"observed.model.schema; is `make up` running with the sidecar's --oip-port?",
              file=sys.stderr)
        return 1
    client = httpclient.InferenceServerClient(oip_url.split("://", 1)[1],
                                              network_timeout=120.0)
    checks: list[tuple[str, object, bool]] = []
    checks.append(("is_server_live", live := client.is_server_live(), live is True))
    checks.append(("is_server_ready", ready := client.is_server_ready(), ready is True))
    checks.append((f"is_model_ready({args.model!r})",
                   mready := client.is_model_ready(args.model), mready is True))
    meta = client.get_model_metadata(args.model)
    names = [i["name"] for i in meta["inputs"] if not i["name"].endswith(".lengths")]
    want = ["dense", *(f["name"] for f in schema["sparse"])]
    checks.append(("metadata inputs == schema", f"{len(names)} inputs", names == want))

    dense, lengths, values = _instances(schema, args.instances, args.seed)
    t0 = time.perf_counter()
    theirs = _oip(client, args.model, schema, dense, lengths, values)
    oip_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    ours = _ours(args.predict_url, dense, lengths, values)
    ours_ms = (time.perf_counter() - t0) * 1e3
    equal = bool(theirs.dtype == np.float32 and theirs.shape == ours.shape
                 and np.array_equal(theirs, ours))
    checks.append((f"infer binary, {args.instances} instances: array_equal to our API",
                   f"max |diff| {float(np.max(np.abs(theirs.astype(np.float64) - ours))):.3g}"
                   if theirs.shape == ours.shape else f"shape {theirs.shape}", equal))

    as_json = _oip(client, args.model, schema, dense, lengths, values, binary=False)
    checks.append((f"infer JSON, {args.instances} instances: array_equal to our API",
                   f"dtype {as_json.dtype}", bool(np.array_equal(as_json, ours))))

    width = max(len(c[0]) for c in checks)
    print(f"OIP base URL {oip_url} (from GET {args.sidecar}/state endpoints.oip_url); "
          f"served version {model.get('version')}; tritonclient.http")
    print(f"{'check':<{width}}  {'value':<24}  ok")
    for name, value, ok in checks:
        print(f"{name:<{width}}  {str(value):<24}  {'yes' if ok else 'NO'}")
    print(f"infer {oip_ms:.1f} ms (OIP, binary), {ours_ms:.1f} ms (our API, binary); "
          f"nnz {int(lengths.sum())}, multi-hot features "
          f"{int((~(lengths == 1).all(axis=1)).sum())}; first probabilities "
          f"{theirs[:3].tolist()}")
    report = {"oip_url": oip_url, "served_version": model.get("version"),
              "instances": args.instances, "seed": args.seed, "nnz": int(lengths.sum()),
              "checks": [{"check": n, "value": str(v), "ok": ok} for n, v, ok in checks],
              "oip_infer_ms": round(oip_ms, 2), "ours_ms": round(ours_ms, 2),
              "passed": all(ok for *_, ok in checks)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
