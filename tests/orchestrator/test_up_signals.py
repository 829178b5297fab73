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

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specserve.devtools.ports import free_port
from tests.support.process_table import Proc, descendants, ignored_signals, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SERVING = "serving; try:"  # printed once the example request was answered
LOADING = "loading models ..."  # printed once all three children bound their ports


def _as_background_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell does for `cmd &`


class Launcher:
    """``python -m specserve up --tiny`` in a child, its output in a file."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.children: list[Proc] = []  # as last read from the process table
        cmd = [sys.executable, "-m", "specserve", "up", "--tiny", "--port", str(free_port())]
        cmd += ["--threads", "1", "--max-new-tokens", "8"]
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_as_background_job
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"specserve up exited {code}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} after {timeout_s} s:\n{self.output()}")
            time.sleep(0.1)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path / "up.log")
    try:
        yield launcher
    finally:  # a failed test still leaves nothing running: kill what is left, by pid
        if launcher.proc.poll() is None:
            launcher.children += descendants(launcher.proc.pid)
            launcher.proc.kill()
            launcher.proc.wait()
        for child in wait_gone(launcher.children, 0):
            os.kill(child.pid, signal.SIGKILL)


def _the_three_children(launcher: Launcher) -> list[Proc]:
    children = descendants(launcher.proc.pid)
    commands = " | ".join(c.cmdline for c in children)
    launcher.children = children
    for module in ("target_service", "draft_service", "orchestrator"):
        assert f"specserve.{module}" in commands, commands
    return children


def _stop_and_check(launcher: Launcher, signum: int, expected_code: int) -> None:
    children = _the_three_children(launcher)
    assert ignored_signals(launcher.proc.pid) & 1 << (signal.SIGINT - 1), "SIGINT not ignored"
    os.kill(launcher.proc.pid, signum)
    assert launcher.proc.wait(timeout=60) == expected_code, launcher.output()
    left = wait_gone(children, timeout_s=30)
    assert not left, "left running: " + " | ".join(f"{c.pid} {c.cmdline}" for c in left)


def test_sigterm_to_a_serving_background_up_stops_every_child(launcher: Launcher) -> None:
    launcher.wait_for(SERVING)
    _stop_and_check(launcher, signal.SIGTERM, 128 + signal.SIGTERM)


def test_sighup_while_loading_stops_every_child(launcher: Launcher) -> None:
    launcher.wait_for(LOADING)
    _stop_and_check(launcher, signal.SIGHUP, 128 + signal.SIGHUP)


def test_children_stop_when_up_is_killed(launcher: Launcher) -> None:
    launcher.wait_for(LOADING)
    _stop_and_check(launcher, signal.SIGKILL, -signal.SIGKILL)
