"""A launcher run as a shell runs a background job (``cmd &``), for the signal tests.

The shell starts a background job with SIGINT ignored, so Ctrl-C is no way to stop
it: SIGTERM (a process manager, ``kill``), SIGHUP (a closed terminal) or SIGKILL is.
:class:`BackgroundJob` starts a command that way, its output in a file; the tests
read its children from the process table, signal the launcher alone, and read the
table again with :func:`signal_and_check`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.process_table import Proc, descendants, ignored_signals, wait_gone


def _as_background_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell does for `cmd &`


class BackgroundJob:
    """``cmd`` in a child process with SIGINT ignored, its output in ``log_path``."""

    def __init__(
        self, cmd: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self.children: list[Proc] = []  # as last read from the process table
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                preexec_fn=_as_background_job,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, *texts: str, timeout_s: float = 300.0) -> None:
        """Wait until the output holds every one of ``texts`` (fails if the job exits)."""
        deadline = time.monotonic() + timeout_s
        while not all(t in self.output() for t in texts):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise AssertionError(f"the launcher exited {code}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {texts!r} after {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)

    def read_children(self, *expected: str) -> list[Proc]:
        """The launcher's live descendants; each of ``expected`` must be in one's command."""
        self.children = descendants(self.proc.pid)
        commands = " | ".join(c.cmdline for c in self.children)
        for text in expected:
            assert text in commands, f"no child running {text!r}: {commands}"
        return self.children

    def cleanup(self) -> None:
        """Kill, by pid, whatever a failed test left: the launcher and its children."""
        if self.proc.poll() is None:
            self.children += descendants(self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        for child in wait_gone(self.children, 0):
            os.kill(child.pid, signal.SIGKILL)


def signal_and_check(
    job: BackgroundJob, signum: int, timeout_s: float = 30.0, *, sigint_ignored: bool = True
) -> int:
    """Signal the launcher alone, wait for it, and fail if any child it had is left
    after ``timeout_s``; the launcher's exit status (negative: killed by that signal).

    ``sigint_ignored``: check that the launcher still ignores SIGINT, as a background
    job does (False for a launcher that installs its own SIGINT handler, as torchrun).
    """
    assert job.children, "read the children first"
    if sigint_ignored:
        assert ignored_signals(job.proc.pid) & 1 << (signal.SIGINT - 1), "SIGINT not ignored"
    os.kill(job.proc.pid, signum)
    code = job.proc.wait(timeout=60)
    left = wait_gone(job.children, timeout_s)
    assert not left, "left running: " + " | ".join(f"{c.pid} {c.cmdline}" for c in left)
    return code


@contextmanager
def one_job_per_signal(
    start: Callable[[str], BackgroundJob], signals: Sequence[int]
) -> Iterator[dict[int, BackgroundJob]]:
    """One launcher per signal, all started at once (``start(name)`` starts one), so a
    module's signal tests wait for one start instead of one each; every job left
    running is killed at the end."""
    jobs: dict[int, BackgroundJob] = {}
    try:
        for signum in signals:
            jobs[signum] = start(signal.Signals(signum).name)
        yield jobs
    finally:
        for job in jobs.values():
            job.cleanup()
