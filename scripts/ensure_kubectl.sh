#!/usr/bin/env bash
# tests/test_k8s.py runs kubectl offline: `kubectl kustomize --load-restrictor ...` builds
# the k8s/cpu overlay, and `kubectl apply -f k8s/ --dry-run=client` checks that every file
# in k8s/ decodes. Install Debian's kubectl when missing.
#
# The python machine image ships kubectl 1.32 (/usr/bin/kubectl), which does both. The
# only kubectl in Debian's archive is kubernetes-client (1.20 on bookworm): enough for the
# apply check, too old for the overlay (its `kubectl kustomize` has no --load-restrictor),
# so this script installs it only where there is no kubectl at all, and says so.
set -euo pipefail
supports_overlay() { kubectl kustomize --help 2>/dev/null | grep -q -- '--load-restrictor'; }
if command -v kubectl >/dev/null 2>&1; then
  if supports_overlay; then exit 0; fi
  echo "==> $(command -v kubectl) is too old to build k8s/cpu (no kustomize --load-restrictor;" >&2
  echo "    1.32 from the python machine image works): install a newer kubectl" >&2
  exit 1
fi
echo "==> installing kubernetes-client (kubectl; tests/test_k8s.py runs it offline)"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq kubernetes-client >/dev/null
kubectl version --client 2>/dev/null | head -n1
if ! supports_overlay; then
  echo "==> WARNING: Debian's kubectl cannot build k8s/cpu (no kustomize --load-restrictor):" >&2
  echo "    the CPU overlay tests in tests/test_k8s.py will fail until a newer kubectl is" >&2
  echo "    installed; the \`kubectl apply\` decode check works with it" >&2
  exit 1
fi
