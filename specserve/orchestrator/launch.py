"""Start an orchestrator as a child process on an ephemeral port and wait until it serves.

The same life cycle as the replicas' :class:`~specserve.serving.launch.ServerProcess`
(port file, health, SIGTERM then SIGKILL), for ``python -m specserve.orchestrator``.
Used by ``specserve up`` and the end-to-end tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from specserve.serving.launch import ServerProcess
from specserve.serving.tls import ClientTls

MODULE = "specserve.orchestrator"


class OrchestratorProcess(ServerProcess):
    """An orchestrator in a child process (a context manager that stops it)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ClientTls | None = None,
    ) -> None:
        # the role only names the module
        super().__init__("target", args, env=env, host=host, tls=tls)
        self.role = "orchestrator"
        self.bind_port = port  # 0 = an ephemeral port

    def start(self, timeout_s: float = 60.0) -> OrchestratorProcess:
        """Spawn the child and wait until it has bound its port (not until it serves)."""
        port_file = Path(self._dir.name) / "port"
        cmd = [
            sys.executable,
            "-m",
            MODULE,
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.bind_port),
            "--port-file",
            str(port_file),
        ]
        proc = self.spawn(cmd)
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {proc.returncode}:\n" + self.output())
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator did not bind in {timeout_s} s:\n" + self.output())
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        return self
