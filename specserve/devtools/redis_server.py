"""A throwaway redis-server on a free loopback port, without persistence.

Integration tests and benchmarks start one per run (``scripts/ensure-redis.sh``
installs the binary); nothing here is used by the services themselves.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from specserve.devtools.ports import free_port
from specserve.serving.supervision import die_with_parent


class RedisNotInstalled(RuntimeError):
    """No ``redis-server`` on PATH."""


@contextmanager
def throwaway_redis(password: str | None = None, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Start redis-server on 127.0.0.1 (no RDB, no AOF, a temporary dir); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisNotInstalled("redis-server is not installed (bash scripts/ensure-redis.sh)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="specserve-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--dir", workdir, "--protected-mode", "no"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent(),  # no redis-server outlives a killed test run
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        auth = f":{password}@" if password else ""
        yield f"redis://{auth}127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
