"""The committed generated code is what scripts/gen-proto.sh makes from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen-proto.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = sorted(p.name for p in (tmp_path / "specserve/v1").glob("*_pb2*"))
    committed = sorted(p.name for p in (ROOT / "specserve/v1").glob("*_pb2*"))
    assert fresh == committed, "generated files differ: run `make proto`"
    for name in fresh:
        a = (tmp_path / "specserve/v1" / name).read_bytes()
        b = (ROOT / "specserve/v1" / name).read_bytes()
        assert a == b, f"specserve/v1/{name} is out of date with proto/: run `make proto`"
