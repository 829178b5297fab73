"""A start killed while it builds the CPU kernels does not hang the next one; and the
builds this CPU cannot run still compile.

The real thing, in a fresh extension cache: a process starts the build and is
SIGKILLed (with its compiler) once torch's builder has taken its ``lock`` file, which
the killed process leaves behind. A second process then builds: it must break the
stale lock with a log line, build, and load, where torch alone would wait for that lock
forever. The build is the widest one this CPU cannot run where there is one (an
AVX-512 + VNNI build on an AVX2 machine: its compile is checked here, once, and the
second process may fail to load it, which is not a failed build), else this CPU's.
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
import torch

from specserve.engine.cpu_kernels import CAPABILITIES, build_isa, library_name
from tests.support.isa import runnable_builds, unrunnable_builds

LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from specserve.engine.cpu_kernels import compile_for
print("loaded", compile_for(sys.argv[1]), flush=True)
"""

pytestmark = [
    pytest.mark.skipif(build_isa() not in CAPABILITIES, reason="no AVX2 or AVX-512"),
    pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler"),
]


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}


def test_a_killed_build_leaves_a_lock_the_next_load_breaks(tmp_path: Path) -> None:
    isa = (unrunnable_builds() or [build_isa()])[0]
    root = tmp_path / "extensions"
    name = library_name(isa)
    build_dir = root / name
    torch_lock = build_dir / "lock"

    first = subprocess.Popen(
        [sys.executable, "-c", LOAD, isa],
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
        [sys.executable, "-c", LOAD, isa],
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,  # torch alone waits for the lock forever
    )
    log = second.stdout + second.stderr
    assert f"removing {torch_lock}: a CPU kernel build was interrupted" in log
    assert "building the CPU kernels for" in log and "first start only" in log
    assert (build_dir / f"{name}.so").exists(), f"the {isa} build failed: {log}"
    if isa in runnable_builds():
        assert second.returncode == 0, log
        assert f"loaded {name}" in log
    assert not torch_lock.exists()


def test_the_cache_name_follows_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    isa = build_isa()
    default = library_name(isa)
    monkeypatch.setenv("CXX", "another-c++")
    assert library_name(isa) != default  # another compiler's build gets its own directory


def test_the_cache_name_follows_the_torch_build_and_the_isa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {library_name(isa) for isa in CAPABILITIES}
    assert len(names) == len(CAPABILITIES)  # one build directory per instruction set
    isa = build_isa() if build_isa() in CAPABILITIES else "AVX2"
    default = library_name(isa)
    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    assert library_name(isa) != default  # another torch's build gets its own directory
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "git_version", "another-commit")
    assert library_name(isa) != default  # so does another build of the same version
