"""A start killed while it builds the CPU kernels does not hang the next one.

The real thing, in a fresh extension cache: a process starts the build and is
SIGKILLed (with its compiler) once torch's builder has taken its ``lock`` file, which
the killed process leaves behind. A second process then loads the kernels: it must
break the stale lock with a log line, build, and load, where torch alone would wait
for that lock forever.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve.engine.cpu_kernels import CAPABILITIES, build_isa, library_name

LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from specserve.engine.cpu_kernels import build_isa, compile_for
print("loaded", compile_for(build_isa()), flush=True)
"""

pytestmark = [
    pytest.mark.skipif(build_isa() not in CAPABILITIES, reason="no AVX2 or AVX-512"),
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler"),
]


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}


def test_a_killed_build_leaves_a_lock_the_next_load_breaks(tmp_path: Path) -> None:
    root = tmp_path / "extensions"
    build_dir = root / library_name(build_isa())
    torch_lock = build_dir / "lock"

    first = subprocess.Popen(
        [sys.executable, "-c", LOAD],
        env=_env(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the compiler dies with it
    )
    deadline = time.monotonic() + 120
    while not torch_lock.exists():
        assert first.poll() is None, first.communicate()[0].decode()
        assert time.monotonic() < deadline, "the build never took torch's lock"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert torch_lock.exists()  # what a killed start leaves behind

    second = subprocess.run(
        [sys.executable, "-c", LOAD],
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,  # torch alone waits for the lock forever
    )
    log = second.stdout + second.stderr
    assert second.returncode == 0, log
    assert f"removing {torch_lock}: a CPU kernel build was interrupted" in log
    assert "building the CPU kernels for" in log and "first start only" in log
    assert f"loaded {library_name(build_isa())}" in log
    assert not torch_lock.exists()


def test_the_cache_name_follows_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    isa = build_isa()
    default = library_name(isa)
    monkeypatch.setenv("CXX", "another-c++")
    assert library_name(isa) != default  # another compiler's build gets its own directory
