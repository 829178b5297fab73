"""The CPU kernels are built at install time: ``make install`` (and so ``make demo``
and ``make test``) runs ``python -m specserve.engine.kernel_prebuild --this-cpu``,
which builds the library this CPU runs, where a server's first start then finds it.

The build here goes to the suite's own cache (``TORCH_EXTENSIONS_DIR`` as the suite
runs), where the tests need it anyway: after the first test that needs the kernels
it is found there, not built again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specserve.engine import kernel_prebuild
from specserve.engine.cpu_kernels import CAPABILITIES, build_isa, build_root, library_name

ROOT = Path(__file__).resolve().parents[2]


def test_this_cpu_means_the_build_a_server_loads() -> None:
    assert kernel_prebuild.capabilities(this_cpu=False) == CAPABILITIES
    isa = build_isa()
    expected = (isa,) if isa in CAPABILITIES else ()
    assert kernel_prebuild.capabilities(this_cpu=True) == expected


def test_prebuild_this_cpu_leaves_the_library_a_server_loads(
    capfd: pytest.CaptureFixture[str],
) -> None:
    isa = build_isa()
    if isa not in CAPABILITIES:
        pytest.skip(f"this CPU ({isa}) has no kernel build")
    assert kernel_prebuild.main(["--this-cpu"]) == 0  # the build itself runs in a child
    name = library_name(isa)
    library = build_root() / name / f"{name}.so"
    assert f"{isa}: {library}" in capfd.readouterr().out
    assert library.exists()


def test_make_install_prebuilds_the_kernels() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*?\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None, "no install recipe in the Makefile"
    steps = recipe.group(1).splitlines()
    prebuild = [i for i, s in enumerate(steps) if "kernel_prebuild --this-cpu" in s]
    package = [i for i, s in enumerate(steps) if "pip install" in s and "-e" in s]
    assert prebuild and package and prebuild[0] > package[-1], steps  # after the install
