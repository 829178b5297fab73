#!/usr/bin/env bash
# Build, and with --push publish, the images the Kubernetes manifests run:
#   <repo>:<version>-cpu    every process on CPU nodes (torch CPU build)
#   <repo>:<version>-cuda   the gpu overlay's tensor-parallel targets (torch CUDA build)
# <repo> is $SPECSERVE_IMAGE_REPO (default ghcr.io/specserve/specserve), <version> the
# project's version from pyproject.toml. In CI: log in to the registry, then
#   SPECSERVE_TORCH_CPU_INDEX=<PyTorch's CPU wheel index> scripts/build-images.sh --push
# --print-tags prints the tags and builds nothing (the deploy tests compare them with
# the manifests). Variants to build may be named: scripts/build-images.sh cpu.
set -euo pipefail
cd "$(dirname "$0")/.."

REPO="${SPECSERVE_IMAGE_REPO:-ghcr.io/specserve/specserve}"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)"
TORCH_VERSION="2.13.0"  # the same pin as the Makefile's CPU wheel
PUSH=0
PRINT=0
VARIANTS=()
for arg in "$@"; do
  case "$arg" in
    --push) PUSH=1 ;;
    --print-tags) PRINT=1 ;;
    cpu|cuda) VARIANTS+=("$arg") ;;
    *) echo "usage: $0 [--push] [--print-tags] [cpu] [cuda]" >&2; exit 2 ;;
  esac
done
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(cpu cuda)

for variant in "${VARIANTS[@]}"; do
  tag="$REPO:$VERSION-$variant"
  if [ "$PRINT" = 1 ]; then
    echo "$tag"
    continue
  fi
  index=""
  if [ "$variant" = cpu ]; then
    index="${SPECSERVE_TORCH_CPU_INDEX:?set SPECSERVE_TORCH_CPU_INDEX to the PyTorch CPU wheel index}"
  fi
  DOCKER_BUILDKIT=1 docker build \
    --platform linux/amd64 \
    --build-arg VARIANT="$variant" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg TORCH_INDEX="$index" \
    --tag "$tag" .
  if [ "$PUSH" = 1 ]; then
    docker push "$tag"
  fi
done
