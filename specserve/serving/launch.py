"""Start a server as a child process on an ephemeral port and wait until it serves.

Used by the tests, the benchmarks and local stacks: the child runs
``python -m specserve.<role>_service ... --port 0 --port-file F`` (or another
module that takes the same serving flags), writes its bound port to F once
listening, and answers health SERVING once its model is loaded. A server started
with TLS flags is checked over TLS: give the process the :class:`ClientTls` to use
(with a client certificate when the server asks for one).

Every child is started with :func:`~specserve.serving.supervision.die_with_parent`:
it gets SIGTERM if the launcher dies without stopping it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.serving.supervision import die_with_parent
from specserve.serving.tls import ClientTls, sync_channel

MODULES = {"draft": "specserve.draft_service", "target": "specserve.target_service"}


class ServerProcess:
    """A draft or target server in a child process (a context manager that stops it)."""

    def __init__(
        self,
        role: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        module: str | None = None,
        tls: ClientTls | None = None,
        cwd: str | None = None,
    ) -> None:
        """``cwd``: the child's working directory (None: this process's). ``python -m``
        puts it first on the child's path, before ``PYTHONPATH``: a server run from
        another checkout needs that checkout as ``cwd``."""
        assert module is not None or role in MODULES, role
        self.role = role
        self.module = module or MODULES[role]
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.host = host
        self.tls = tls  # how health checks reach it (None: plaintext)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix=f"specserve-{role}-")
        self.log_path = Path(self._dir.name) / "server.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        """Spawn the child and wait until it has bound its port (not until it serves)."""
        port_file = Path(self._dir.name) / "port"
        port_file.unlink(missing_ok=True)  # left by an earlier start of this object
        cmd = [
            sys.executable,
            "-m",
            self.module,
            *self.args,
            "--host",
            self.host,
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ]
        proc = self.spawn(cmd)
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.role} server exited with {proc.returncode}:\n" + self.output()
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.role} server did not bind in {timeout_s} s:\n" + self.output()
                )
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        return self

    def spawn(self, cmd: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start ``cmd`` as this object's child, its output to :attr:`log_path`; the
        child gets SIGTERM if this process dies (see :mod:`specserve.serving.supervision`)."""
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                preexec_fn=die_with_parent(),
            )
        return self.proc

    def health(self, service: str = "", timeout_s: float = 2.0) -> int:
        """The health status the server reports now (a HealthCheckResponse.ServingStatus)."""
        with sync_channel(self.address, self.tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=service)
            return stub.Check(request, timeout=timeout_s).status

    def _health_or_none(self) -> int | None:
        try:
            return self.health()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return None

    def wait_serving(self, timeout_s: float = 60.0) -> ServerProcess:
        """Wait until health reports SERVING (the model is loaded). A health call that
        misses its own deadline counts as not yet serving: a server loading a model on
        a busy host may not answer within it."""
        deadline = time.monotonic() + timeout_s
        while self._health_or_none() != health_pb2.HealthCheckResponse.SERVING:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} server exited:\n" + self.output())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} server not SERVING after {timeout_s} s")
            time.sleep(0.02)
        return self

    def terminate(self) -> None:
        """Send SIGTERM (graceful shutdown) without waiting; :meth:`stop` waits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL if it lingers; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def output(self) -> str:
        """What the child printed so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._dir.cleanup()


def stop_all(processes: Sequence[ServerProcess | None], timeout_s: float = 15.0) -> None:
    """Stop every process, all draining at once: SIGTERM to each first, then wait for
    each (SIGKILL past ``timeout_s`` from now). None entries are skipped."""
    started = [p for p in processes if p is not None]
    for p in started:
        p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in started:
        p.stop(max(0.0, deadline - time.monotonic()))
