"""Start the HTTP server as a child process on an ephemeral port and wait until it serves.

For tests, benchmarks and local stacks, like
:class:`~specserve.orchestrator.launch.OrchestratorProcess`: the child writes its bound
port to a file; "serving" is ``GET /health`` answering 200 (the orchestrator behind
it answers SERVING).
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from specserve.serving.launch import ServerProcess

MODULE = "specserve.openai_api"


class HttpServerProcess(ServerProcess):
    """``python -m specserve.openai_api --orchestrator ADDR ...`` in a child process."""

    def __init__(
        self,
        orchestrator: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(
            "http", ["--orchestrator", orchestrator, *args], env=env, host=host, module=MODULE
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> HttpServerProcess:
        port_file = Path(self._dir.name) / "port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", MODULE, *self.args, "--host", self.host, "--port", "0"]
        cmd += ["--port-file", str(port_file)]
        proc = self.spawn(cmd)
        deadline = time.monotonic() + timeout_s
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None:
                raise RuntimeError(f"http server exited with {proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"http server did not bind in {timeout_s} s:\n{self.output()}")
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        return self

    def health(self, service: str = "", timeout_s: float = 2.0) -> int:
        """The HTTP status of GET /health (0 when nothing answers)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout_s) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def wait_serving(self, timeout_s: float = 60.0) -> HttpServerProcess:
        deadline = time.monotonic() + timeout_s
        while self.health() != 200:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"http server exited:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"http server not serving after {timeout_s} s:\n{self.output()}")
            time.sleep(0.05)
        return self
