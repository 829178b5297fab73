#!/usr/bin/env bash
# Integration tests start a real redis-server on a loopback port; install it when missing.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # Debian starts a system instance on 6379; the tests start their own, so stop it.
  (service redis-server stop || true) >/dev/null 2>&1
else
  echo "redis-server is not installed; run: sudo apt-get install -y redis-server" >&2
  exit 1
fi
