#!/usr/bin/env bash
# The offline /docs test (tests/test_docs_offline.py) renders the sidecar's Swagger UI in
# a headless browser. Install Debian's chromium when missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
echo "==> installing chromium (headless browser for tests/test_docs_offline.py)"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
chromium --version
