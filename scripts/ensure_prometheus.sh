#!/usr/bin/env bash
# The monitoring tests (tests/test_monitoring_rules.py) run `promtool check rules` and
# `promtool test rules` on k8s/monitoring/, and integration tests run a real Prometheus
# against the sidecar. Install Debian's prometheus package (both binaries) when missing.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
echo "==> installing prometheus (prometheus + promtool: the alert-rule tests need promtool)"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  prometheus >/dev/null
prometheus --version 2>&1 | head -1
