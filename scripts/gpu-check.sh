#!/usr/bin/env bash
# The checks only a CUDA machine can run, in one go, most telling first, each with its
# own time limit (together under ten minutes): the `gpu` tests; the stack against the
# local loop with both servers on CUDA (bench.concurrency --device cuda, writes
# bench/results/concurrency_cuda.{md,json,png}); the stack on CUDA through `specserve
# up`; the engine's round on the GPU (bench/results/device_round_cuda.{md,json}); and the
# RPC overhead on the GPU host's CPUs, hot and after 12 ms asleep (printed, not written).
# After every step the results written so far are archived in OUT_DIR/results.tgz, so a
# run cut short still returns what it measured. Run from the repository root with a
# Python that has a CUDA build of torch and the project's dependencies.
# Usage: scripts/gpu-check.sh [OUT_DIR]   (logs go to OUT_DIR, default ./gpu-check)
set -uo pipefail
out="${1:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(0))' || exit 2

step() {  # step NAME SECONDS COMMAND...: run, log to OUT_DIR/NAME.log, print its tail
  local name=$1 limit=$2 started=$SECONDS; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - started)) s"; tail -n 6 "$out/$name.log"
  tar czf "$out/results.tgz" bench/results/*_cuda.* 2>/dev/null
}

# Only the files that hold gpu tests: collecting the rest needs every dev dependency.
mapfile -t gpu_files < <(grep -rl "mark.gpu" tests --include='test_*.py')
step gpu-tests 180 "$py" -m pytest -q -rs -p no:cacheprovider -m gpu "${gpu_files[@]}"
# Tiny pair (the emulated_gpu defaults) in float32 so every variant's greedy tokens agree;
# both servers share the one GPU but run as separate processes, declared separate devices.
SPECSERVE_DEVICES=separate step stack-cuda 200 "$py" -m bench.concurrency --device cuda \
  --target tiny:3 --draft tiny:3:noise=0.05 --target-dtype float32 --draft-dtype float32 \
  --concurrency 1,8,32 --reps 2 --new-tokens 64 --name concurrency_cuda
step up-cuda 60 "$py" -m specserve up --tiny --device cuda --once --max-new-tokens 64
step device-round 120 "$py" -m bench.device_round --device cuda
step rpc-overhead 90 "$py" -m bench.rpc_overhead --models stub --rounds 200 --no-write
