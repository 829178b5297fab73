#!/usr/bin/env bash
# The checks only a CUDA machine can run, in one go, each with its own time limit:
# the `gpu` tests, the stack on CUDA, the engine's round on the GPU (writes
# bench/results/device_round_cuda.{md,json}), and the RPC overhead on the GPU host's
# CPUs, hot and after 12 ms asleep (printed, not written). Run from the repository
# root with a Python that has a CUDA build of torch and the project's dependencies.
# Usage: scripts/gpu-check.sh [OUT_DIR]   (logs go to OUT_DIR, default ./gpu-check)
set -uo pipefail
out="${1:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(0))' || exit 2

step() {  # step NAME SECONDS COMMAND...: run, log to OUT_DIR/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc=$?"; tail -n 6 "$out/$name.log"
}

# Only the files that hold gpu tests: collecting the rest needs every dev dependency.
mapfile -t gpu_files < <(grep -rl "mark.gpu" tests --include='test_*.py')
step gpu-tests 240 "$py" -m pytest -q -rs -p no:cacheprovider -m gpu "${gpu_files[@]}"
step up-cuda 120 "$py" -m specserve up --tiny --device cuda --once --max-new-tokens 64
step device-round 240 "$py" -m bench.device_round --device cuda
step rpc-overhead 120 "$py" -m bench.rpc_overhead --models stub --rounds 200 --no-write
