"""Build the files ``bench.gpu_check`` carries to the GPU machine (which has no TorchRec).

    python -m bench.make_gpu_fixture [--out bench/gpu_fixture]

Writes (< 1 MB in all):
    tiny_int8.pt   a random ``tiny`` DLRM quantized by TorchRec (int8), as our artifact
    expected.pt    input batches (one-hot and multi-hot, ids beyond the rows) with the CPU
                   runtime's probabilities and TorchRec's own, for the exactness check
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import torch

from serve.model.export import artifact_from_quantized_dlrm
from serve.profiles import get_profile
from serve.runtime.artifact import save_artifact
from serve.runtime.engine import Runtime, RuntimeConfig, SparseBatch

__all__ = ["main", "make_batches"]

FORMAT = 1


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Zipf-skewed batches of sizes 1, 7, 64, 256; odd ones multi-hot (0..3 ids)."""
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, 2001, dtype=torch.float64) ** 1.1
    out = []
    for i, b in enumerate((1, 7, 64, 256)):
        lengths = (torch.randint(0, 4, (26, b), generator=g, dtype=torch.int32) if i % 2
                   else torch.ones((26, b), dtype=torch.int32))
        values = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)
        out.append({"dense": torch.randn(b, 13, generator=g), "values": values,
                    "lengths": lengths})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/gpu_fixture"))
    args = p.parse_args(argv)
    from torchrec.inference.modules import quantize_inference_model

    from serve.model.dlrm import build_dlrm, make_kjt

    profile = get_profile("tiny")
    model = build_dlrm(profile, seed=0).eval()
    sparse_arch: Any = model.sparse_arch   # nn.Module attributes type as Tensor | Module
    with torch.no_grad():   # spread the default tiny init so interactions matter
        for t in sparse_arch.embedding_bag_collection.embedding_bags.values():
            t.weight.mul_(20.0)
    qmodel = quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.int8).eval()
    art = artifact_from_quantized_dlrm(qmodel, "int8", meta={"origin": "bench.make_gpu_fixture"})
    rt = Runtime.from_artifact(art, RuntimeConfig())
    batches = make_batches()
    rows = torch.tensor(profile.cardinalities)
    for bt in batches:
        per_feature = bt["lengths"].sum(1)
        vals = (bt["values"] % rows.repeat_interleave(per_feature)).split(per_feature.tolist())
        kjt = make_kjt(profile.feature_names, list(vals), list(bt["lengths"]))
        with torch.no_grad():
            bt["torchrec"] = torch.sigmoid(qmodel(bt["dense"], kjt).squeeze(1))
        bt["expected"] = rt.predict(bt["dense"], SparseBatch(bt["values"], bt["lengths"]))
        diff = (bt["expected"] - bt["torchrec"]).abs().max().item()
        print(f"batch {bt['dense'].shape[0]:>4}: CPU runtime vs TorchRec max |dp| {diff:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    save_artifact(art, args.out / "tiny_int8.pt")
    torch.save({"format": FORMAT, "torch": str(torch.__version__), "batches": batches},
               args.out / "expected.pt")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out}/tiny_int8.pt and expected.pt ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
