"""Prebuild the CPU kernels for every instruction set, for an image without compilers.

``python -m specserve.engine.kernel_prebuild`` compiles :mod:`specserve.engine.cpu_kernels`
for AVX-512 and AVX2 into ``TORCH_EXTENSIONS_DIR`` (torch's default cache when unset:
run it once after ``pip install`` so no server builds at its first start), whatever
the building machine's
CPU: each build runs in a child process, and a build counts as done when its shared
library exists (a child may not be able to load the AVX-512 library it just built
on a CPU without AVX-512; that is not a failed build). Exit status 0 when every
library exists, 1 otherwise, with one line per instruction set on stdout.

A container that copies the directory to the same path (``cp -a``) loads the
libraries without a compiler: torch's JIT cache finds them up to date.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from specserve.engine.cpu_kernels import CAPABILITIES, build_root, library_name


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


def main() -> int:
    root = extensions_dir()
    print(f"building the CPU kernels in {root} (about a minute each)", flush=True)
    missing = 0
    for capability in CAPABILITIES:
        library = prebuild(capability, root)
        print(f"{capability}: {library or 'build failed'}")
        missing += library is None
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
