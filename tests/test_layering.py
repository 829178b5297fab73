"""Import direction between the packages: each layer imports nothing above it.

Every module of a layer is imported in a fresh interpreter, and the modules that got
loaded are checked against what that layer may not reach. A lazy import inside a
function is not seen here; it still has to follow the same direction.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROGRAM = """
import importlib, json, pkgutil, sys
root = sys.argv[1]
module = importlib.import_module(root)
if hasattr(module, "__path__"):
    for info in pkgutil.walk_packages(module.__path__, root + "."):
        importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""

_ABOVE_ENGINE = (
    "specserve.model_store",
    "specserve.local",
    "specserve.serving",
    "specserve.draft_service",
    "specserve.target_service",
    "specserve.orchestrator",
    "specserve.openai_api",
    "specserve.telemetry",
    "specserve.client",
    "specserve.cli",
    "specserve.v1",
    "grpc",
    "redis",
    "opentelemetry",
)

# layer -> module prefixes it must not import (its own package excepted)
LAYERS: dict[str, tuple[str, ...]] = {
    "specserve.engine": _ABOVE_ENGINE,
    "specserve.model_store": tuple(m for m in _ABOVE_ENGINE if m != "specserve.model_store"),
}


def loaded_modules(root: str) -> list[str]:
    """Every module in ``sys.modules`` after importing all of ``root`` in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM, root], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layer_imports_nothing_above_it(layer: str) -> None:
    forbidden = LAYERS[layer]
    leaks = [
        name
        for name in loaded_modules(layer)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not leaks, f"{layer} imports {', '.join(leaks)}"
