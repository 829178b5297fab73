"""AVX-512 / AVX2 kernels for the few-token float32 steps of decoding (``cpu_kernels.cpp``).

Activations are float32; weight matrices are float32, bfloat16 or GGML quantized
blocks. A bfloat16 weight is widened to float32 as it is loaded (exact: a 16-bit
shift), so its product has the bits
of the float32 kernel on ``w.float()`` while half the bytes come from memory: a 1-row
product over 72 [4864, 896] weights took 30 ms against 49 ms in float32 here (2 threads).

A decode or verify step multiplies 1 to k + 1 rows by every weight of the model, so
it is bound by streaming the weights from memory. MKL's ``sgemm`` re-reads a weight
once per ~3 rows, so a 5-row product costs about twice a 1-row one; and between two
weight streams (which evict the caches) each small torch op costs ~100-250 us of
cache misses instead of ~10 us. The kernels here answer both:

``linears(x, ws, bs)``
    ``[x @ w.T + b for w, b]`` reading each weight row once for all rows of ``x``.
    Output rows are cut into blocks of 8 (up to 3 rows of ``x``) or 4 weight rows
    (AVX2: 4 or 1); ``at::parallel_for`` (torch's own intra-op threads) gives each
    thread a contiguous run of blocks; register tiles of 3 x 8 or 6 x 4 accumulators
    (AVX2: 1 x 4 or 6 x 1), and past one tile of rows the weights go in chunks of 256
    floats that every tile of rows meets while they sit in L1. Each output is one dot
    product accumulated in 16 fixed lanes over the input and summed in a fixed order,
    so a row's result does not depend on how many rows came with it, on the thread
    count or on the blocking: verify-step products are bit-identical to one-token
    ones. Weights that share the input (q/k/v) are one range for the threads and land
    side by side in one ``[rows, sum(out)]`` buffer, like a fused weight without
    copying one; the results are column views.
``gate_up_silu(x, wg, wu)``
    ``silu(x @ wg.T) * (x @ wu.T)`` with the same tiles (same bits for both
    products), the activation applied per block: no gate/up tensors, no extra ops.
``q8_linears(x, ws, types, bs)``, ``q8_gate_up_silu(x, wg, tg, wu, tu)``
    The same for GGML block-quantized weights (uint8 blocks ``[out, bytes_per_row]``,
    ``types`` their GGML numbers, :class:`~specserve.engine.quant.GGMLType`), any row
    count, multiplied as llama.cpp does (``cpu_kernels_int8.cpp``): each row of ``x`` is
    quantized alone to 8-bit blocks (256 values with one float scale and the sums of
    every 16 for Q4_K / Q6_K, 32 values for Q5_0 / Q8_0), and each weight block meets a
    block of the row in exact int32 multiply-adds (AVX2 ``maddubs``/``madd``, or VNNI
    ``vpdpwssd``/``vpdpbusd``, the same sums), then one float FMA per block into 8 lanes,
    summed in a fixed order. A weight block is decoded once for up to 8 rows of ``x``;
    blocks of 16 weight rows are the unit of the thread split and stay in L2 while
    every tile of rows meets them. **Batch invariant**: a row's result is one function
    of that row and the weight, whatever the row count, tiles or threads, so a verify
    of k + 1 rows (or a chunked prefill) gives every row the bits of a one-token step.
    The AVX2 and VNNI builds give the same bits too (same integers, same float ops).
    Not the float32 model dequantized from the file: the activations are rounded to
    8 bits per block (docs/exactness.md measures the difference).
``repack_q4_k_x8(blocks, K)``, ``repack_q6_k_x8(blocks, K)``, ``repack_q5_0_x8(blocks, K)``
    Q4_K, Q6_K and Q5_0 weights as the engine multiplies them (:mod:`specserve.engine.ops`
    repacks each once, at its first product): 8 weight rows interleaved 4 bytes at a
    time (llama.cpp's repacking idea, our own layout: ``cpu_kernels_int8.cpp``), rows
    padded to a multiple of 8, the same bytes per row (Q4_K: 148 instead of 144 per 256
    values). A 32-byte load then holds 4 values of 8 rows, meets 4 activations of one
    row broadcast, and several such products add up in int16 before one multiply by
    the 8 rows' scales: about half the instructions per row of the row-major layout,
    so a verify of 5 rows costs ~1.4x a one-row step instead of ~2x (1.5B Q4_K_M, AVX2,
    2 threads). The 8 lanes of a result are the 8 rows' outputs; each sees its blocks
    in order with the same operations for any row count (batch invariant as above).
    The type code of a repacked weight is its GGML type | 1 << 16; Q8_0 stays
    row-major.
``dequantize(blocks, type, K)``
    The float32 matrix of quantized rows (``cpu_kernels_qblocks.cpp`` and
    ``cpu_kernels_quant.cpp``: the reference dequantization's float operations in
    registers, bit for bit, in parallel).
``rms_norm(x, w, eps)``
    ``w * (x * rsqrt(mean(x^2) + eps))`` per row, one op instead of seven.
``rope_cache_attention(q, k, v, ...)``
    RoPE, the paged KV-cache write and causal GQA attention (optional sliding
    window, optional score soft-cap ``softcap``, 0 for none) for a few packed new tokens
    of a ragged batch: one op instead of ~35.
``decoder_layer(h, ws, types, outs, bs, norms, eps, head_dim, <attention's arguments>)``
    A whole decoder layer of quantized weights (``cpu_kernels_layer.cpp``): the norms,
    ``q8_linears`` for q/k/v, ``rope_cache_attention`` (no soft-cap: a Llama layer has
    none), the output projection and the
    SwiGLU MLP with the residual adds, the same functions in the same order as the
    separate ops (the same bits), called from C++: a step of a 28-layer model makes 28
    calls from Python instead of ~400.
``coupled_argmax(probs, keys)``
    The coupled token of each row (:mod:`specserve.engine.coupling`) in one pass:
    the noise is hashed id by id and a logarithm taken only where a bound says the
    id could win, instead of ~20 torch ops over the vocabulary.

One source serves three builds, picked by torch's CPU capability (so
``ATEN_CPU_CAPABILITY=avx2`` forces the AVX2 build on an AVX-512 machine, as it does
torch's own kernels): AVX-512 with VNNI (``-mavx512vnni -mavx512vl`` on top of the
next), AVX-512 (``-mavx512f -mavx512bw -mfma``) or AVX2 + FMA (``-mavx2 -mfma``), each
in its own cache directory. The 16 lanes of a dot product are one zmm register or two ymm ones, with
smaller register tiles on AVX2 (16 ymm registers, not 32 zmm); the FMAs per lane and
the fixed-order sum of the lanes are the same operations either way, so the two builds
should give the same bits as well (by construction; not compared on one machine).

The source is compiled on first use with ``torch.utils.cpp_extension`` (about a
minute on two cores, then cached on disk by torch; images ship it prebuilt,
:mod:`specserve.engine.kernel_prebuild`). :func:`kernels` returns ``None`` where that is
impossible (neither AVX-512 nor AVX2, no compiler, a build error); :mod:`specserve.engine.ops`
then uses torch.

**A build that was killed** leaves torch's ``lock`` file in the build directory, and
torch then waits for it forever, silently. Every build here first takes an
exclusive ``flock`` on ``specserve-build.lock`` in that directory: the kernel drops
it when its holder dies, so a process that holds it knows no specserve process is
building there, and removes a leftover ``lock`` with a warning. A process that waits
for another's build, or builds, says so in the log first.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_LIB = "specserve_cpu"
_SOURCES = (
    "cpu_kernels.cpp",
    "cpu_kernels_qblocks.cpp",
    "cpu_kernels_quant.cpp",
    "cpu_kernels_int8.cpp",
    "cpu_kernels_attention.cpp",
    "cpu_kernels_layer.cpp",
)

# Compiler flags per torch CPU capability; the define picks the vector code in the source.
CAPABILITIES = ("AVX512_VNNI", "AVX512", "AVX2")
_AVX512 = ["-mavx512f", "-mavx512bw", "-mfma", "-mf16c", "-DSPECSERVE_AVX512"]
_ISA_FLAGS = {
    # torch's AVX512 capability implies AVX512BW (byte and word operations) as well.
    "AVX512_VNNI": [*_AVX512, "-mavx512vl", "-mavx512vnni", "-DSPECSERVE_VNNI"],
    "AVX512": _AVX512,
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DSPECSERVE_AVX2"],
}

LinearsFn = Callable[
    [torch.Tensor, Sequence[torch.Tensor], Sequence[torch.Tensor | None]], list[torch.Tensor]
]


@dataclass(frozen=True)
class Kernels:
    """The compiled ops (float32, CPU, no autograd); shapes as in the module doc."""

    linears: LinearsFn
    gate_up_silu: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rope_cache_attention: Callable[..., torch.Tensor]
    coupled_argmax: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Quantized weights: uint8 blocks, each with its GGML type.
    q8_linears: Callable[..., list[torch.Tensor]]
    q8_gate_up_silu: Callable[..., torch.Tensor]
    repack_q4_k_x8: Callable[[torch.Tensor, int], torch.Tensor]
    repack_q6_k_x8: Callable[[torch.Tensor, int], torch.Tensor]
    repack_q5_0_x8: Callable[[torch.Tensor, int], torch.Tensor]
    dequantize: Callable[[torch.Tensor, int, int], torch.Tensor]
    decoder_layer: Callable[..., torch.Tensor]


_lock = threading.Lock()
_state: dict[str, Kernels | None] = {}


def _source_and_flags(capability: str) -> tuple[str, list[str], str]:
    """The source, compiler flags and library name for ``capability``."""
    # One compilation unit: the quantized weights' code uses the tile code before it.
    package = resources.files(__package__)
    source = "\n".join(package.joinpath(f).read_text() for f in _SOURCES)
    flags = [
        "-O3",
        *_ISA_FLAGS[capability],
        "-fopenmp",  # at::parallel_for is inline OpenMP; torch's libgomp is reused
    ]
    # One build directory (and op namespace) per source version, instruction set and
    # everything else that makes two builds differ (the torch build, the Python ABI,
    # the compiler): torch's JIT cache is keyed by name, and two installs sharing a
    # cache would otherwise load, or rebuild over, each other's library.
    toolchain = [
        torch.__version__,
        str(torch.version.git_version),
        str(sysconfig.get_config_var("SOABI")),
        os.environ.get("CXX", "c++"),  # what torch's builder compiles with
    ]
    digest = hashlib.sha256("\n".join([source, *flags, *toolchain]).encode())
    digest = digest.hexdigest()[:12]
    return source, flags, f"{_LIB}_{digest}"


def library_name(capability: str) -> str:
    """The JIT cache's name (a directory under ``TORCH_EXTENSIONS_DIR``) for ``capability``."""
    return _source_and_flags(capability)[2]


def build_root() -> Path:
    """The directory torch's JIT cache builds in: ``TORCH_EXTENSIONS_DIR``, else torch's
    default (under ``HOME``, one folder per Python version and accelerator)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    # torch's own rule for the default, so a build here lands where torch's would.
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


@contextmanager
def exclusive_build(build_dir: Path, capability: str) -> Iterator[None]:
    """Hold this machine's build of ``build_dir`` for the block, breaking a stale lock.

    Takes an exclusive ``flock`` on ``build_dir/specserve-build.lock`` (waiting, with a
    log line, while another process holds it). Holding it means no specserve process
    is building there, so torch's ``lock`` file, if present, was left by a build that
    was killed: it is removed with a warning, or torch would wait for it forever. A
    directory where the lock file cannot be created (read-only) is used as it is.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(build_dir / "specserve-build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.debug("no build lock in %s (%s): loading without it", build_dir, e)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(
                "waiting for another process that is building the CPU kernels in %s", build_dir
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        torch_lock = build_dir / "lock"
        if torch_lock.exists():
            log.warning(
                "removing %s: a CPU kernel build was interrupted there (no process builds "
                "now), and torch would wait for its lock forever",
                torch_lock,
            )
            torch_lock.unlink(missing_ok=True)
        if not any(build_dir.glob("*.so")):
            log.info(
                "building the CPU kernels for %s in %s (first start only, about a minute)",
                capability,
                build_dir,
            )
        yield
    finally:
        os.close(fd)  # releases the flock


def compile_for(capability: str) -> str:
    """Compile (or find in torch's JIT cache) and load the library for ``capability``
    ("AVX512" or "AVX2"); returns its op namespace. Raises where that is impossible.

    The cache lives in :func:`build_root` (``TORCH_EXTENSIONS_DIR``, or torch's default
    under ``HOME``); a library built at the same path is reused without a compiler,
    which is how an image ships the kernels prebuilt
    (:mod:`specserve.engine.kernel_prebuild`). A stale lock left there by a killed
    build is broken (:func:`exclusive_build`).
    """
    from torch.utils.cpp_extension import load_inline

    source, flags, name = _source_and_flags(capability)
    build_dir = build_root() / name
    with exclusive_build(build_dir, capability):
        load_inline(
            name,
            [source],
            extra_cflags=[*flags, f"-DLIBNAME={name}"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            no_implicit_headers=True,
            build_directory=str(build_dir),
        )
    return name


def build_isa() -> str:
    """The build this CPU runs: torch's capability ("AVX512", "AVX2", ...; it honours
    ``ATEN_CPU_CAPABILITY``), refined to "AVX512_VNNI" where the CPU has VNNI.
    ``SPECSERVE_CPU_ISA=AVX2`` (read when the kernels are first built, like torch's own
    variable when it is imported) forces the AVX2 build on a wider CPU: how benchmarks
    measure the AVX2 path on an AVX-512 machine."""
    forced = os.environ.get("SPECSERVE_CPU_ISA", "").upper()
    if forced == "AVX2" and torch.cpu._is_avx2_supported():
        return "AVX2"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512" and torch.cpu._is_vnni_supported():
        return "AVX512_VNNI"
    return cap


def _build() -> Kernels | None:
    isa = build_isa()
    if isa not in _ISA_FLAGS:
        log.info(
            "the CPU has neither AVX-512 nor AVX2 (%s): the engine uses torch ops only",
            isa,
        )
        return None
    try:
        name = compile_for(isa)
    except Exception as exc:  # no source, compiler or headers, a failed build: fall back
        log.warning("CPU kernels unavailable (%s); the engine uses torch ops only", exc)
        return None
    log.info("CPU kernels built for %s", isa)
    from specserve.engine import kernel_fakes  # (imports torch.library's machinery: lazily)

    kernel_fakes.register(name)  # shapes for torch.compile; the ops run as before
    lib = getattr(torch.ops, name)
    return Kernels(
        lib.linears.default,
        lib.gate_up_silu.default,
        lib.rms_norm.default,
        lib.rope_cache_attention.default,
        lib.coupled_argmax.default,
        lib.q8_linears.default,
        lib.q8_gate_up_silu.default,
        lib.repack_q4_k_x8.default,
        lib.repack_q6_k_x8.default,
        lib.repack_q5_0_x8.default,
        lib.dequantize.default,
        lib.decoder_layer.default,
    )


def kernels() -> Kernels | None:
    """The compiled ops, or ``None`` where they cannot be built; built once per process."""
    if "ops" in _state:  # the hot path: no lock once built
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _build()
        return _state["ops"]
