"""A plain launcher: ``python -m tests.support.launcher_program`` starts the HTTP server
through its launch class (:class:`~specserve.openai_api.launch.HttpServerProcess`, a
:class:`~specserve.serving.launch.ServerProcess` like the orchestrator's and the
replicas'), prints ``launched`` and sleeps.

It installs no signal handler: SIGTERM and SIGHUP end it at once, as SIGKILL does,
without stopping its child, so only what the launch class asks of the kernel (the
parent-death signal) can stop it. The orchestrator behind the HTTP server is an
address nothing listens on: the server binds its port and answers 503 on
``/health``, which is all a signal test needs, and starts in about two seconds.
"""

from __future__ import annotations

import signal
import time

from specserve.devtools.ports import free_port
from specserve.openai_api.launch import HttpServerProcess

LAUNCHED = "launched"


def main() -> None:
    # No handler, and not ignored either: a suite started under nohup hands its
    # children SIGHUP ignored, which would keep this launcher alive past the signal.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    HttpServerProcess(f"127.0.0.1:{free_port()}").start()
    print(LAUNCHED, flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
