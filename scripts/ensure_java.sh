#!/usr/bin/env bash
# TorchServe's frontend needs a Java 11+ runtime. Install Debian's when missing.
set -euo pipefail
if command -v java >/dev/null 2>&1; then
  v=$(java -version 2>&1 | head -n1 | sed -E 's/.*"([0-9]+).*/\1/')
  if [ "${v:-0}" -ge 11 ] 2>/dev/null; then exit 0; fi
  echo "==> java $v is too old for TorchServe (needs 11+)"
fi
echo "==> installing openjdk-17-jre-headless (TorchServe's frontend needs Java 11+)"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless >/dev/null
java -version
