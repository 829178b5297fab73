"""Which CPU kernel builds this machine runs, and which it can only compile."""

from __future__ import annotations

from specserve.engine import cpu_kernels

# The builds a CPU of each class runs (a wider CPU runs the narrower builds too).
_RUNS = {
    "AVX512_VNNI": ["AVX512_VNNI", "AVX512", "AVX2"],
    "AVX512": ["AVX512", "AVX2"],
    "AVX2": ["AVX2"],
}


def runnable_builds() -> list[str]:
    """The kernel builds this CPU runs (none where it has neither AVX-512 nor AVX2)."""
    return _RUNS.get(cpu_kernels.build_isa(), [])


def unrunnable_builds() -> list[str]:
    """The kernel builds this CPU cannot run, widest first: compiled here, never loaded."""
    return [isa for isa in cpu_kernels.CAPABILITIES if isa not in runnable_builds()]
