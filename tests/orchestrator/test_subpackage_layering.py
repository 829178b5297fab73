"""The orchestrator's subpackages import each other in one direction only.

Every ``import`` in a subpackage's modules (lazy ones inside functions included) is
read with :mod:`ast`; an import of an orchestrator unit not in the subpackage's
allowed set fails. The order, bottom up: ``types``; ``fleet``; ``errors``; ``store``;
``session``; ``snapshots``; ``round``; ``api``; the top-level wiring (``app``,
``config``, ``flags``, ``metrics``, ``launch``) may import any of them. The scheduling
policy is its own package below the orchestrator (``specserve.policy``: its imports are
``tests/test_layering.py``'s and ``tests/policy/test_purity.py``'s to check).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specserve.orchestrator

PACKAGE = "specserve.orchestrator"
ROOT = Path(specserve.orchestrator.__file__).parent

# unit -> the other orchestrator units it may import
ALLOWED: dict[str, frozenset[str]] = {
    "types": frozenset(),
    "fleet": frozenset({"types"}),
    "errors": frozenset({"fleet"}),
    "store": frozenset({"types", "errors"}),
    "session": frozenset({"types", "store"}),
    "snapshots": frozenset({"types", "fleet", "errors", "store", "session"}),
    "round": frozenset({"types", "fleet", "errors", "store", "session", "snapshots"}),
    "api": frozenset({"types", "fleet", "errors", "store", "session", "snapshots", "round"}),
}


def imported_units(path: Path) -> set[str]:
    """The orchestrator units (first name under the package) that ``path`` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:
                names.update(f"{PACKAGE}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    prefix = PACKAGE + "."
    return {n[len(prefix) :].split(".")[0] for n in names if n.startswith(prefix)}


def unit_files(unit: str) -> list[Path]:
    folder = ROOT / unit
    return sorted(folder.glob("*.py")) if folder.is_dir() else [ROOT / f"{unit}.py"]


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_unit_imports_only_what_lies_below_it(unit: str) -> None:
    files = unit_files(unit)
    assert files and all(f.exists() for f in files), f"no module for {unit}"
    leaks = {
        f"{f.relative_to(ROOT)} imports {PACKAGE}.{other}"
        for f in files
        for other in imported_units(f) - ALLOWED[unit] - {unit}
    }
    assert not leaks, "; ".join(sorted(leaks))


def test_every_subpackage_is_placed() -> None:
    """A new subpackage needs its place in the order before it can land."""
    subpackages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert subpackages <= set(ALLOWED), sorted(subpackages - set(ALLOWED))


def test_no_subpackage_has_more_than_ten_modules() -> None:
    crowded = {
        p.name: n
        for p in ROOT.iterdir()
        if p.is_dir() and (n := len([f for f in p.glob("*.py") if f.name != "__init__.py"])) > 10
    }
    assert not crowded, crowded
