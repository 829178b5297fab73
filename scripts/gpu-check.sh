#!/usr/bin/env bash
# The checks only a CUDA machine can run, in one go, most telling first, each with its own
# time limit (the limits add up to 7.9 minutes, so one device call of eight holds them all):
#   gpu-tests       the `gpu` tests but the inductor one: CUDA graphs captured == eager
#                   tokens, batch-invariant bfloat16 speculation == target-only, the rest
#   device-shapes   Qwen2.5-7B-shaped target and 0.5B-shaped draft, random bfloat16 weights
#                   made on the device: step time against the HBM floor, verify cost by
#                   rows 1..9, the draft's step (bench/results/device_shapes_cuda.*)
#   round-graphs    the engine's round with the target's steps replayed as CUDA graphs
#                   (bench/results/device_round_cuda.*)
#   round-eager     the same round on the eager forward (device_round_cuda_eager.*)
#   inductor        torch.compile(fullgraph=True, inductor) steps == eager steps on CUDA
#   stack-cuda      the stack against the local loop, both servers on CUDA, 1 and 8
#                   sessions (bench/results/concurrency_cuda.*)
#   up-cuda         `specserve up --tiny --device cuda --once`
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
  echo "== $name: rc=$? in $((SECONDS - started)) s"; tail -n 8 "$out/$name.log"
  tar czf "$out/results.tgz" bench/results/*_cuda* 2>/dev/null
}

# Only the files that hold gpu tests: collecting the rest needs every dev dependency.
mapfile -t gpu_files < <(grep -rl "mark.gpu" tests --include='test_*.py')
step gpu-tests 120 "$py" -m pytest -q -rs -p no:cacheprovider -m gpu -k "not inductor" \
  "${gpu_files[@]}"
step device-shapes 90 "$py" -m bench.device_shapes --device cuda --rows 1-9 --sessions 1,8 \
  --reps 20
step round-graphs 60 "$py" -m bench.device_round --device cuda --steps graphs --sessions 1,8 \
  --reps 2
step round-eager 40 "$py" -m bench.device_round --device cuda --steps eager --sessions 1,8 \
  --reps 2
step inductor 60 "$py" -m pytest -q -rs -p no:cacheprovider -m gpu -k inductor \
  tests/engine/test_static_step.py
# Tiny pair (the emulated_gpu defaults) in float32 so every variant's greedy tokens agree;
# both servers share the one GPU but run as separate processes, declared separate devices.
SPECSERVE_DEVICES=separate step stack-cuda 75 "$py" -m bench.concurrency --device cuda \
  --target tiny:3 --draft tiny:3:noise=0.05 --target-dtype float32 --draft-dtype float32 \
  --concurrency 1,8 --reps 1 --new-tokens 48 --name concurrency_cuda
step up-cuda 30 "$py" -m specserve up --tiny --device cuda --once --max-new-tokens 64
