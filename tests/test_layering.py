"""Import direction between the packages: each layer imports nothing above it.

Two checks. Every import statement of every module of a layer, lazy ones inside
functions included, is read from the source (fast, and it sees what a run might not
reach). And the engine and the model store are imported whole in a fresh interpreter,
which also catches a module pulled in through a third party or a re-export.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import specserve

ROOT = Path(specserve.__file__).parent

_ENTRY_POINTS = (
    "specserve.local",
    "specserve.openai_api",
    "specserve.client",
    "specserve.cli",
    "specserve.cli_",  # a trailing "_" matches every module that starts with it
    "specserve.__main__",
)
_SERVICES = ("specserve.draft_service", "specserve.target_service")
_ABOVE_ENGINE = (
    "specserve.model_store",
    "specserve.wire",
    "specserve.serving",
    *_SERVICES,
    "specserve.orchestrator",
    *_ENTRY_POINTS,
    "specserve.telemetry",
    "specserve.v1",
    "grpc",
    "redis",
    "opentelemetry",
)
# The service-facing converters: the generated messages and the engine, nothing else.
_WIRE = (
    "specserve.model_store",
    "specserve.serving",
    *_SERVICES,
    "specserve.orchestrator",
    *_ENTRY_POINTS,
    "specserve.telemetry",
    "grpc",
    "redis",
    "opentelemetry",
)

# layer (a package: every module in it; or one module) -> what it must not import
LAYERS: dict[str, tuple[str, ...]] = {
    # The scheduling policy: pure bookkeeping under the engine and the orchestrator alike.
    "specserve.policy": ("specserve.engine", *_ABOVE_ENGINE, "torch", "asyncio"),
    "specserve.engine": _ABOVE_ENGINE,
    "specserve.model_store": tuple(m for m in _ABOVE_ENGINE if m != "specserve.model_store"),
    "specserve.wire.common_wire": _WIRE,
    "specserve.wire.draft_wire": _WIRE,
    "specserve.wire.target_wire": _WIRE,
    "specserve.wire.sparse_q": _WIRE,
    "specserve.serving": (*_SERVICES, "specserve.orchestrator", *_ENTRY_POINTS, "redis"),
    "specserve.draft_service": (
        "specserve.target_service",
        "specserve.orchestrator",
        *_ENTRY_POINTS,
        "redis",
    ),
    "specserve.target_service": (
        "specserve.draft_service",
        "specserve.orchestrator",
        *_ENTRY_POINTS,
        "redis",
    ),
    "specserve.orchestrator": (*_SERVICES, *_ENTRY_POINTS),
}


def _matches(name: str, prefix: str) -> bool:
    if prefix.endswith("_"):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def _sources(layer: str) -> list[Path]:
    path = ROOT.parent.joinpath(*layer.split("."))
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def _imported(source: Path) -> set[str]:
    """Every absolute module an import statement in ``source`` may name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)  # ``from pkg import module`` names pkg.module too
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_layer_has_sources() -> None:
    for layer in LAYERS:
        assert all(p.is_file() for p in _sources(layer)), layer


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_import_statement_reaches_above_its_layer(layer: str) -> None:
    leaks = [
        f"{source.relative_to(ROOT.parent)} imports {name}"
        for source in _sources(layer)
        for name in sorted(_imported(source))
        if any(_matches(name, prefix) for prefix in LAYERS[layer])
    ]
    assert not leaks, "\n".join(leaks)


_PROGRAM = """
import importlib, json, pkgutil, sys
root = sys.argv[1]
module = importlib.import_module(root)
if hasattr(module, "__path__"):
    for info in pkgutil.walk_packages(module.__path__, root + "."):
        importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("layer", ["specserve.engine", "specserve.model_store"])
def test_importing_the_layer_loads_nothing_above_it(layer: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM, layer], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    leaks = [m for m in loaded if any(_matches(m, prefix) for prefix in LAYERS[layer])]
    assert not leaks, f"importing {layer} loads {', '.join(leaks)}"
