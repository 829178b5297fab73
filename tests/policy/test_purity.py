"""The policy package imports no I/O library: checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("grpc", "redis", "opentelemetry", "asyncio")


def imported_by(module: str) -> list[str]:
    """The top-level packages in ``sys.modules`` after importing ``module`` alone."""
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_policy_package_imports_no_grpc_redis_opentelemetry_or_asyncio() -> None:
    loaded = imported_by("specserve.policy")
    assert "specserve.policy.planner" in loaded  # the whole package was loaded
    leaked = sorted({m.split(".")[0] for m in loaded} & set(FORBIDDEN))
    assert leaked == [], f"the policy package pulls in {leaked}"


def test_the_check_sees_an_io_import() -> None:
    """The same check flags a module that does import one (so it can fail)."""
    loaded = imported_by("specserve.orchestrator.round.calls")
    assert {"grpc", "asyncio"} <= {m.split(".")[0] for m in loaded}
