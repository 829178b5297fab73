"""torchrun, the tensor-parallel target's launcher, leaves no rank behind however it
is stopped.

torchrun starts each rank in a session of its own and asks the kernel for no
parent-death signal; on SIGTERM and SIGHUP it passes the signal to its ranks. Each
test starts ``torchrun --nproc-per-node 2 -m specserve.target_service --tp 2`` (a
tiny model, gloo on loopback) as a background job (SIGINT ignored; torchrun then
installs its own SIGINT handler), waits until both ranks formed the group, signals
torchrun alone, and reads the process table:

* SIGTERM: rank 0 drains and closes the group, rank 1 leaves with it;
* SIGHUP: both ranks end (by SIGHUP's default action: no drain);
* SIGKILL: torchrun runs nothing; each rank asked for SIGTERM at its start
  (:func:`~specserve.serving.supervision.stop_with_parent`), so rank 0 drains and
  closes the group as on SIGTERM. Before that request both ranks served on.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.background import BackgroundJob, one_job_per_signal, signal_and_check
from tests.tp.ranks import LOOPBACK, free_port
from tests.tp.service_program import COMMON, GLOO_ENV

pytestmark = [
    pytest.mark.tp,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

RANK0 = "tensor-parallel rank 0 of 2 (torchrun"
RANK1 = "tensor-parallel rank 1 of 2"
CLOSED = "closing the tensor-parallel group (2 ranks)"
RANK_COMMAND = "-m specserve.target_service"


SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, BackgroundJob]]:
    """One torchrun group per signal, all started at once; each once both ranks run."""
    logs = tmp_path_factory.mktemp("torchrun")

    def start(name: str) -> BackgroundJob:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += ["--master-addr", LOOPBACK, "--master-port", str(free_port())]
        cmd += ["-m", "specserve.target_service", "--model", "tiny:7", "--tp", "2"]
        cmd += ["--tp-backend", "gloo", "--host", LOOPBACK, "--port", str(free_port())]
        cmd += ["--grace-s", "1", *COMMON]
        return BackgroundJob(cmd, Path(logs / f"{name}.log"), env=GLOO_ENV)

    with one_job_per_signal(start, SIGNALS) as jobs:
        for job in jobs.values():
            job.wait_for(RANK0, RANK1, timeout_s=120)
        yield jobs


def _stop(groups: dict[int, BackgroundJob], signum: int) -> BackgroundJob:
    job = groups[signum]
    ranks = [r for r in job.read_children(RANK_COMMAND) if RANK_COMMAND in r.cmdline]
    assert len(ranks) == 2, ranks
    code = signal_and_check(job, signum, sigint_ignored=False)
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL
    return job


def test_sigterm_to_a_background_torchrun_stops_both_ranks(
    groups: dict[int, BackgroundJob],
) -> None:
    job = _stop(groups, signal.SIGTERM)
    assert CLOSED in job.output()  # rank 0 drained and closed the group


def test_sighup_to_torchrun_stops_both_ranks(groups: dict[int, BackgroundJob]) -> None:
    _stop(groups, signal.SIGHUP)


def test_ranks_stop_when_torchrun_is_killed(groups: dict[int, BackgroundJob]) -> None:
    job = _stop(groups, signal.SIGKILL)
    assert CLOSED in job.output(), job.output()[-3000:]  # rank 0 got SIGTERM, drained
