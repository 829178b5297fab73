"""The tests' redis-server: :mod:`specserve.devtools.redis_server`, skipping where absent,
and :class:`RestartableRedis`, one that can be stopped and started again on its port."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from specserve.devtools.ports import free_port
from specserve.devtools.redis_server import throwaway_redis

__all__ = ["RestartableRedis", "free_port", "redis_server", "restartable_redis"]


@contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """Start redis-server; yields its URL. Skips the caller's test when it is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/ensure-redis.sh)")
    with throwaway_redis(password) as url:
        yield url


class RestartableRedis:
    """A redis-server on a fixed loopback port whose data survive a restart (an RDB file
    saved at shutdown, as a production Redis keeps its data with AOF or RDB)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="specserve-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        """SHUTDOWN SAVE: the data go to disk, the port closes, every connection drops."""
        assert self.proc is not None
        with contextlib.suppress(redis.ConnectionError):  # it drops the connection as it goes
            redis.Redis(port=self.port, socket_timeout=5).shutdown(save=True)
        self.proc.wait(timeout=10)
        self.proc = None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def bytes_in(self) -> int:
        """Bytes every client has sent this server since it started (INFO stats)."""
        return int(redis.Redis(port=self.port).info("stats")["total_net_input_bytes"])


@contextmanager
def restartable_redis() -> Iterator[RestartableRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/ensure-redis.sh)")
    server = RestartableRedis()
    try:
        server.start()
        yield server
    finally:
        server.close()
