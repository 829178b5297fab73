"""Prebuild the CPU kernels at install time, so no server builds them at its first start.

``python -m specserve.engine.kernel_prebuild`` compiles :mod:`specserve.engine.cpu_kernels`
for AVX-512 (with and without VNNI) and AVX2 into ``TORCH_EXTENSIONS_DIR`` (torch's
default cache when unset), whatever the building machine's CPU: what an image
without compilers ships. ``--this-cpu`` builds only the library this machine runs
(what ``make install`` does after ``pip install``). Each build runs in a child
process, and a build counts as done when its shared library exists (a child may not
be able to load the AVX-512 library it just built on a CPU without AVX-512; that is
not a failed build). Exit status 0 when every library asked for exists, 1 otherwise,
with one line per instruction set on stdout. A library already built is found in
the cache and not built again.

A container that copies the directory to the same path (``cp -a``) loads the
libraries without a compiler: torch's JIT cache finds them up to date.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from specserve.engine.cpu_kernels import CAPABILITIES, build_isa, build_root, library_name


def extensions_dir() -> Path:
    """Where torch's JIT cache puts the builds: ``TORCH_EXTENSIONS_DIR``, else torch's
    default (where a server on this machine looks for them)."""
    return build_root()


def prebuild(capability: str, root: Path) -> Path | None:
    """Build the library for ``capability`` under ``root``; its path, or None if missing."""
    code = f"from specserve.engine.cpu_kernels import compile_for; compile_for({capability!r})"
    subprocess.run([sys.executable, "-c", code], check=False)
    name = library_name(capability)
    library = root / name / f"{name}.so"
    return library if library.exists() else None


def capabilities(this_cpu: bool) -> tuple[str, ...]:
    """What to build: every instruction set, or only the one this CPU runs (none where
    the CPU has neither AVX-512 nor AVX2: the engine then uses torch ops)."""
    if not this_cpu:
        return CAPABILITIES
    isa = build_isa()
    return (isa,) if isa in CAPABILITIES else ()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.engine.kernel_prebuild",
        description="Build the CPU kernels ahead of the first server start.",
    )
    parser.add_argument(
        "--this-cpu", action="store_true", help="build only the library this machine's CPU runs"
    )
    args = parser.parse_args(argv)
    root = extensions_dir()
    wanted = capabilities(args.this_cpu)
    if not wanted:
        print(f"this CPU ({build_isa()}) runs no kernel build: the engine uses torch ops")
        return 0
    print(f"the CPU kernels ({', '.join(wanted)}) in {root}: building what is missing", flush=True)
    missing = 0
    for capability in wanted:
        library = prebuild(capability, root)
        print(f"{capability}: {library or 'build failed'}")
        missing += library is None
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
