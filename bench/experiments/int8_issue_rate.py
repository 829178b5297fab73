"""How many 8-bit multiply-adds this core can issue, against what the kernels reach.

The integer kernels (``specserve/engine/cpu_kernels_int8.cpp``) multiply 8-bit weights
by 8-bit activations with ``vpmaddubsw`` (32 products an instruction, 256-bit), adding
the int16 results with ``vpaddw``; the 8-row layouts broadcast four activation bytes
per product (``vpbroadcastd``). Three loops written in assembly (x86-64, AVX2) time
what the core issues when nothing else runs: the product alone, the product and its
add, and the broadcast, product and add of the 8-row kernels' inner loop. A dependent
chain of scalar adds (one a cycle) gives the clock. Then the Q4_K and Q6_K 8-row
kernels of the library are timed on one thread over a weight that stays in cache,
at 1 to ``--max-rows`` rows: their multiply-adds a second against the third loop's,
the ceiling of any kernel built from those instructions on this core.

So a verify's marginal row can be priced on any machine before tuning: a row of the
1.5B target is ~1.5 G multiply-adds, at the ceiling's rate per core. Prints a table;
writes nothing. Needs a C++ compiler and an x86-64 CPU with AVX2.

    .venv/bin/python -m bench.experiments.int8_issue_rate
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specserve.engine import cpu_kernels, ops
from specserve.engine.quant import GGMLType
from specserve.engine.quant.synthetic import random_weight

# Each loop body: 8 independent instructions (or groups) so that no latency chain
# limits the issue rate; ymm0 / ymm1 hold the operands, %0 a 64-byte buffer.
_LOOPS = {
    "vpmaddubsw": "".join(f"vpmaddubsw %%ymm0, %%ymm1, %%ymm{r}\\n" for r in range(2, 10)),
    "vpmaddubsw + vpaddw": "".join(
        f"vpmaddubsw %%ymm0, %%ymm1, %%ymm{r}\\n vpaddw %%ymm{r}, %%ymm{r + 8}, %%ymm{r + 8}\\n"
        for r in range(2, 8)
    ),
    "vpbroadcastd + vpmaddubsw + vpaddw": "".join(
        f"vpbroadcastd {4 * r}(%0), %%ymm{r}\\n vpmaddubsw %%ymm{r}, %%ymm0, %%ymm{r}\\n"
        f" vpaddw %%ymm{r}, %%ymm{r + 8}, %%ymm{r + 8}\\n"
        for r in range(2, 8)
    ),
}
_COUNTS = {"vpmaddubsw": 8, "vpmaddubsw + vpaddw": 6, "vpbroadcastd + vpmaddubsw + vpaddw": 6}
OUT = 2048  # the kernels' weight rows
_CLOBBER = ",".join(f'"xmm{r}"' for r in range(2, 16))

_SOURCE = """
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
alignas(64) static int32_t buf[16];
static double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
int main(int argc, char** argv) {
  const long n = argc > 1 ? atol(argv[1]) : 100000000L;
  const int32_t* p = buf;
  long v = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0" : "+r"(v));
  printf("clock %.6f\\n", n / seconds(t0));
%(loops)s
  return 0;
}
"""


def _program() -> str:
    loops = []
    for name, body in _LOOPS.items():
        loops.append(
            "  t0 = std::chrono::steady_clock::now();\n"
            f'  for (long i = 0; i < n; ++i) __asm__ volatile("{body}" :: "r"(p) : {_CLOBBER});\n'
            f'  printf("{name}|%.6f\\n", n * {_COUNTS[name]}.0 / seconds(t0));\n'
        )
    return _SOURCE.replace("%(loops)s", "".join(loops))


def issue_rates(iterations: int) -> tuple[float, dict[str, float]]:
    """(the clock in Hz, each loop's groups a second), from a compiled probe."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "probe.cpp"), Path(tmp, "probe")
        src.write_text(_program())
        subprocess.run([compiler, "-O2", "-mavx2", str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(iterations)], check=True, capture_output=True)
    lines = out.stdout.decode().splitlines()
    clock = float(lines[0].split()[1])
    rates = {name: float(rate) for name, rate in (line.split("|") for line in lines[1:])}
    return clock, rates


def kernel_rate(ggml_type: GGMLType, rows: int, reps: int) -> float:
    """Multiply-adds a second of the library's 8-row kernel for ``ggml_type`` on one
    thread, ``rows`` activation rows, over an ``OUT`` (2048) x 1536 weight (1.7-2.5 MB: in the
    last-level cache after the first call, as large as a call needs to make the op's own
    overhead small): the fastest of ``reps`` calls of 8 products."""
    kern = cpu_kernels.kernels()
    assert kern is not None
    blocks, code = ops.packed_blocks(kern, random_weight(ggml_type, OUT, 1536, 0, (1e-5, 2e-3)))
    x = torch.randn(rows, 1536)
    kern.q8_linears(x, [blocks], [code], [None])
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(8):
            kern.q8_linears(x, [blocks], [code], [None])
        times.append(time.perf_counter() - start)
    return 8 * rows * OUT * 1536 / min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=100_000_000, help="per assembly loop")
    p.add_argument("--max-rows", type=int, default=9)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if platform.machine() not in ("x86_64", "AMD64") or cpu_kernels.kernels() is None:
        print("needs an x86-64 CPU with AVX2 and the CPU kernels", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    clock, rates = issue_rates(args.iterations)
    print(f"# 8-bit multiply-adds on one core ({cpu_kernels.build_isa()} build)\n")
    print(f"clock (dependent adds): {clock / 1e9:.2f} GHz\n")
    print("| loop | per cycle | G multiply-adds/s |\n| --- | ---: | ---: |")
    for name, rate in rates.items():
        print(f"| {name} | {rate / clock:.2f} | {32 * rate / 1e9:.1f} |")
    ceiling = 32 * rates["vpbroadcastd + vpmaddubsw + vpaddw"]
    print("\n| kernel | rows | G multiply-adds/s | of the broadcast loop |")
    print("| --- | ---: | ---: | ---: |")
    for ggml_type in (GGMLType.Q4_K, GGMLType.Q6_K):
        for rows in range(1, args.max_rows + 1):
            rate = statistics.fmean(kernel_rate(ggml_type, rows, args.reps) for _ in range(2))
            print(f"| {ggml_type.name} x8 | {rows} | {rate / 1e9:.1f} | {rate / ceiling:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
