#!/usr/bin/env bash
# Regenerate the Python code for proto/specserve/v1/*.proto into specserve/v1/.
# Usage: scripts/gen-proto.sh [OUT_DIR]   (default: the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
py="${PYTHON:-.venv/bin/python}"
mkdir -p "$out/specserve/v1"
"$py" -m grpc_tools.protoc -I proto \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  proto/specserve/v1/*.proto
touch "$out/specserve/v1/__init__.py"
