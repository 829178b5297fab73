"""``specserve up`` leaves no child behind, however it is stopped.

The launcher runs as a shell runs a background job (``specserve up &``): SIGINT
ignored, so Ctrl-C is no way to stop it. Each test starts the real stack (tiny
models, embedded store), reads its children from the process table, signals the
launcher alone, and reads the table again: every child must be gone.

* SIGTERM, once the stack serves: the launcher stops its children and exits 143.
* SIGHUP, while the models load: the same, exit 129.
* SIGKILL, while the models load: the launcher runs nothing, and the children stop
  on the parent-death signal they asked the kernel for.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specserve.devtools.ports import free_port
from tests.support.background import BackgroundJob, signal_and_check

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SERVING = "serving; try:"  # printed once the example request was answered
LOADING = "loading models ..."  # printed once all three children bound their ports
CHILDREN = ("specserve.target_service", "specserve.draft_service", "specserve.orchestrator")


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[BackgroundJob]:
    cmd = [sys.executable, "-m", "specserve", "up", "--tiny", "--port", str(free_port())]
    cmd += ["--threads", "1", "--max-new-tokens", "8"]
    job = BackgroundJob(cmd, tmp_path / "up.log")
    try:
        yield job
    finally:  # a failed test still leaves nothing running
        job.cleanup()


def _stop_and_check(launcher: BackgroundJob, signum: int, expected_code: int) -> None:
    launcher.read_children(*CHILDREN)
    assert signal_and_check(launcher, signum) == expected_code, launcher.output()


def test_sigterm_to_a_serving_background_up_stops_every_child(launcher: BackgroundJob) -> None:
    launcher.wait_for(SERVING)
    _stop_and_check(launcher, signal.SIGTERM, 128 + signal.SIGTERM)


def test_sighup_while_loading_stops_every_child(launcher: BackgroundJob) -> None:
    launcher.wait_for(LOADING)
    _stop_and_check(launcher, signal.SIGHUP, 128 + signal.SIGHUP)


def test_children_stop_when_up_is_killed(launcher: BackgroundJob) -> None:
    launcher.wait_for(LOADING)
    _stop_and_check(launcher, signal.SIGKILL, -signal.SIGKILL)
