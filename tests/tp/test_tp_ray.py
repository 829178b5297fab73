"""A Ray-launched TP=2 group (one actor per rank in a placement group) on loopback.

The group runs in a subprocess (:mod:`tests.tp.ray_program`): inside a new network
namespace with only loopback when ``unshare -n`` works here, otherwise on a local
Ray cluster whose node address is 127.0.0.1. Either way gloo is pinned to ``lo``.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tp.isolation import netns_prefix

pytestmark = [
    pytest.mark.tp,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="Ray is not installed: pip install -e '.[tp]'",
    ),
]

REPO = Path(__file__).resolve().parents[2]


def test_ray_group_decodes_as_the_torchrun_group(
    tmp_path: Path, tp2_greedy: dict[str, Any]
) -> None:
    command = [*netns_prefix(), sys.executable, "-m", "tests.tp.ray_program", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = pickle.loads((tmp_path / "ray.pkl").read_bytes())
    if "skip" in report:
        pytest.skip(report["skip"])
    assert report["healthy_before"]
    assert report["result"] == tp2_greedy
    assert report["result"]["spec_accepted"] > 0
    assert report["error"] is not None and "tensor-parallel" in report["error"]
    assert not report["healthy_after_kill"] and not report["healthy_after_close"]
