"""Children that stop with the process that launched them.

A launcher (``specserve up``, the tests' and benchmarks' stacks) starts servers as
child processes. Three ways it can end, and what stops its children in each:

* **SIGINT** (Ctrl-C in a terminal): the terminal signals the whole foreground
  process group, children included, and Python raises ``KeyboardInterrupt`` in
  the launcher, whose ``finally`` blocks stop them.
* **SIGTERM or SIGHUP** (systemd, a container runtime, a CI job, ``kill``, a
  closed terminal): only the launcher is signalled, and Python's default is to
  die at once without running ``finally``. Inside :func:`stop_on_signals` both
  raise :class:`StopSignal` in the main thread instead, so the same ``finally``
  blocks run. This holds in the background too, where the shell started the
  launcher with SIGINT ignored.
* **death** (SIGKILL, a crash): nothing runs in the launcher. Every child started
  with :func:`die_with_parent` as its ``preexec_fn`` asked the kernel (Linux
  ``PR_SET_PDEATHSIG``) to be sent SIGTERM when its parent goes, and drains and
  exits as it does on any SIGTERM.

``PR_SET_PDEATHSIG`` follows the *thread* that forked the child: start children
from the main thread (or from a thread that outlives them).

A launcher that is not ours may ask nothing of the kernel: torchrun starts each rank
in a session of its own and without a parent-death signal, so a SIGKILLed torchrun
left both ranks serving. A process started that way asks for itself, first thing,
with :func:`stop_with_parent`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class StopSignal(BaseException):
    """SIGTERM or SIGHUP arrived in a launcher: unwind and stop the children.

    A ``BaseException`` like ``KeyboardInterrupt``, so ``except Exception`` does not
    swallow it. ``exit_code`` is the shell's convention for death by that signal.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`StopSignal` (main thread only).

    Only the first signal raises: one that arrives while the ``finally`` blocks are
    stopping the children is logged and ignored, so the cleanup is not cut short.
    The previous handlers are restored on exit.
    """
    raised = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal raised
        if raised:
            log.warning("%s while stopping; still stopping", signal.Signals(signum).name)
            return
        raised = True
        raise StopSignal(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets SIGTERM when the
    launcher dies (None where the platform has no parent-death signal).

    Everything the child needs is looked up here, in the parent, so the function
    run between fork and exec only makes one system call. If the parent died
    before the request took effect, the child signals itself at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent went between fork and prctl
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def stop_with_parent(signum: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``signum`` when this process's parent dies (from inside the
    child, for a launcher that did not ask: see the module docstring).

    Returns False where the platform has no parent-death signal. If the parent is
    already gone (this process was adopted by init before it asked), the signal is
    sent at once. Called early, from the main thread; it holds across ``exec``.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        log.warning("no parent-death signal (prctl: errno %d)", ctypes.get_errno())
        return False
    if parent == 1 or os.getppid() != parent:  # the launcher went before we asked
        os.kill(os.getpid(), signum)
    return True
