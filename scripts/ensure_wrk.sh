#!/usr/bin/env bash
# make bench-autotune (bench/bench_autotune.py) drives its load with wrk: one C process
# that holds 64 connections at a few thousand requests/s on one core, where a Python
# load generator would take the cores the service is measured on. Install Debian's wrk
# package when missing.
set -euo pipefail
if command -v wrk >/dev/null 2>&1; then
  exit 0
fi
echo "==> installing wrk (the HTTP load generator of make bench-autotune)"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  wrk >/dev/null
wrk --version 2>&1 | head -1 || true
