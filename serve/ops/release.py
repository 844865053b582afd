"""Write the pushed images' digests into k8s/ (``make release-manifests``): the manifests
deploy ``<image>:<tag>@sha256:<digest>``, never a tag alone (a tag can be re-pushed).

    python -m serve.ops.release --image REG/dlrm-serve --tag 0.1.0 \\
        [--gpu-digest sha256:<hex> --cpu-digest sha256:<hex>]   # else resolved from the registry
    python -m serve.ops.release --check                          # exit 1 while a digest is UNRELEASED

What it rewrites, and nothing else (comments and layout kept): every ``image:`` line of
``k8s/deployment.yaml`` and ``k8s/templates/*.yaml`` (the GPU image) and the ``images:``
entry of ``k8s/cpu/kustomization.yaml`` (``name``, ``newTag: <tag>-cpu``, ``digest``).
Without ``--*-digest`` it asks the registry (``docker buildx imagetools inspect``) for the
digest each pushed tag points at: run it right after ``docker push``, from the same tree.

Until the first release the committed manifests carry :data:`UNRELEASED` (all zeros): no
registry holds it, so they cannot deploy anything rather than deploying a mutable tag.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from serve.errors import ConfigError

__all__ = ["UNRELEASED", "image_refs", "main", "resolve_digest", "write_digests"]

_REPO = Path(__file__).resolve().parents[2]
#: The digest the manifests carry before any release (resolves nowhere).
UNRELEASED = "sha256:" + "0" * 64
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_IMAGE_LINE = re.compile(r"^(?P<lead>\s*-?\s*image:\s*)(?P<ref>\S+)(?P<tail>\s*(?:#.*)?)$",
                         re.MULTILINE)


def _gpu_files(k8s: Path) -> list[Path]:
    return [k8s / "deployment.yaml", *sorted((k8s / "templates").glob("*.yaml"))]


def _check_digest(what: str, digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise ConfigError(f"{what}={digest!r} must be sha256:<64 lowercase hex> (the pushed "
                          "image's digest: docker buildx imagetools inspect <image>:<tag>)")
    return digest


def write_digests(k8s: Path, image: str, tag: str, gpu_digest: str, cpu_digest: str) -> list[Path]:
    """Point every image reference of ``k8s`` at ``image:tag@gpu_digest`` (the overlay at
    ``image:tag-cpu@cpu_digest``); return the files that changed.

    Raises:
        ConfigError: a digest that is not sha256:<64 hex>, or an overlay without exactly one
            image entry.
    """
    _check_digest("gpu digest", gpu_digest)
    _check_digest("cpu digest", cpu_digest)
    changed = []
    for path in _gpu_files(k8s):
        text = path.read_text()
        new = _IMAGE_LINE.sub(lambda m: f"{m['lead']}{image}:{tag}@{gpu_digest}{m['tail']}", text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    kust = k8s / "cpu" / "kustomization.yaml"
    text = kust.read_text()
    block = re.search(r"^images:\n(?:  .*\n)+", text, re.MULTILINE)
    if block is None or block.group(0).count("- name:") != 1:
        raise ConfigError(f"{kust}: expected one entry under images: (the serving image)")
    entry = (f"images:\n  - name: {image}\n    newTag: {tag}-cpu\n"
             f"    digest: {cpu_digest}\n")
    new = text[:block.start()] + entry + text[block.end():]
    if new != text:
        kust.write_text(new)
        changed.append(kust)
    return changed


def image_refs(k8s: Path) -> list[str]:
    """Every image reference the manifests deploy: the GPU files' ``image:`` values and
    the overlay's ``name:newTag@digest``."""
    import yaml

    refs = [m["ref"] for p in _gpu_files(k8s) for m in _IMAGE_LINE.finditer(p.read_text())]
    kust = yaml.safe_load((k8s / "cpu" / "kustomization.yaml").read_text())
    for img in kust.get("images") or []:
        ref = img["name"] + (f":{img['newTag']}" if "newTag" in img else "")
        refs.append(ref + (f"@{img['digest']}" if "digest" in img else ""))
    return refs


def resolve_digest(ref: str, timeout_s: float = 120.0) -> str:
    """The digest ``ref`` (a pushed ``image:tag``) points at in its registry.

    Raises:
        ConfigError: docker buildx missing, the registry unreachable or the tag unknown.
    """
    cmd = ["docker", "buildx", "imagetools", "inspect", ref, "--format", "{{.Manifest.Digest}}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"cannot resolve {ref}: {e}; give the digest instead") from None
    digest = out.stdout.strip()
    if out.returncode != 0 or not _DIGEST.fullmatch(digest):
        raise ConfigError(f"cannot resolve {ref} (exit {out.returncode}: "
                          f"{(out.stderr or out.stdout).strip()[-300:]}): push it first, or "
                          "give its digest (GPU_DIGEST=/CPU_DIGEST=)")
    return digest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve.ops.release", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k8s", type=Path, default=_REPO / "k8s")
    ap.add_argument("--image", default="dlrm-serve", help="repository the image was pushed to")
    ap.add_argument("--tag", default="0.1.0")
    ap.add_argument("--gpu-digest", help="sha256:<hex> of <image>:<tag> (default: ask the registry)")
    ap.add_argument("--cpu-digest", help="sha256:<hex> of <image>:<tag>-cpu (default: ask the registry)")
    ap.add_argument("--check", action="store_true",
                    help="only check: exit 1 when a reference is UNRELEASED or has no digest")
    args = ap.parse_args(argv)
    if args.check:
        bad = [r for r in image_refs(args.k8s) if "@sha256:" not in r or r.endswith(UNRELEASED)]
        for r in bad:
            print(f"release-manifests: {r} is not a released digest: run make release-manifests "
                  "after pushing", file=sys.stderr)
        return 1 if bad else 0
    try:
        gpu = args.gpu_digest or resolve_digest(f"{args.image}:{args.tag}")
        cpu = args.cpu_digest or resolve_digest(f"{args.image}:{args.tag}-cpu")
        changed = write_digests(args.k8s, args.image, args.tag, gpu, cpu)
    except ConfigError as e:
        print(f"release-manifests: {e.message}", file=sys.stderr)
        return 2
    print(f"release-manifests: {args.image}:{args.tag}@{gpu}, {args.image}:{args.tag}-cpu@{cpu}; "
          f"changed {[str(p) for p in changed] or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
