"""A program that starts the HTTP server through its launch class leaves nothing
behind, however it ends.

The launcher (:mod:`tests.support.launcher_program`) runs as a background job
(SIGINT ignored) and has no signal handler of its own, so SIGTERM, SIGHUP and
SIGKILL all end it without a ``finally``: its child must stop on the parent-death
signal :class:`~specserve.serving.launch.ServerProcess` asks for, which the
orchestrator's and the replicas' launch classes ask for the same way (``specserve
up``, which starts those and also stops them itself, is tested in
``tests/orchestrator/test_up_signals.py``; torchrun in ``tests/tp/test_tp_signals.py``).
One launcher per signal, all started at once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.background import BackgroundJob, one_job_per_signal, signal_and_check
from tests.support.launcher_program import LAUNCHED

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

CHILD = "-m specserve.openai_api"
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)


@pytest.fixture(scope="module")
def launchers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, BackgroundJob]]:
    logs = tmp_path_factory.mktemp("launchers")

    def start(name: str) -> BackgroundJob:
        cmd = [sys.executable, "-m", "tests.support.launcher_program"]
        return BackgroundJob(cmd, Path(logs / f"{name}.log"))

    with one_job_per_signal(start, SIGNALS) as jobs:
        for job in jobs.values():
            job.wait_for(LAUNCHED, timeout_s=120)
        yield jobs


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_a_launched_http_server_stops_with_its_launcher(
    launchers: dict[int, BackgroundJob], signum: signal.Signals
) -> None:
    job = launchers[signum]
    job.read_children(CHILD)
    assert signal_and_check(job, signum, timeout_s=20) == -signum, job.output()
