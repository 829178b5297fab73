"""A server start killed during the CPU kernels' build, then the next starts.

In a fresh kernel cache (a temporary ``TORCH_EXTENSIONS_DIR``): a tiny draft server
starts and builds the kernels; 3 s after torch's builder took its ``lock`` the server
and its compiler are SIGKILLed, which leaves that lock behind. A second start must
break it (with its log line), build, and answer SERVING in about the time a first
start takes; a third start finds the library built. Prints the three times and the
second start's kernel log lines. Costs two kernel compiles; not run by the suite
(``tests/engine/test_kernel_build_lock.py`` is the same at the kernel loader's level).

    .venv/bin/python -m bench.experiments.killed_kernel_build
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from specserve.engine.cpu_kernels import build_isa, library_name
from specserve.serving.launch import ServerProcess

ARGS = ["--model", "tiny:3", "--threads", "1"]


def _tree(pid: int) -> list[int]:
    """``pid``'s descendants, from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if stat:
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _serving_after(env: dict[str, str]) -> tuple[float, str]:
    server = ServerProcess("draft", ARGS, env=env)
    started = time.monotonic()
    server.start(120).wait_serving(600)
    seconds = time.monotonic() - started
    output = server.output()
    server.stop()
    return seconds, output


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="specserve-killed-build-"))
    env = {"TORCH_EXTENSIONS_DIR": str(root)}
    lock = root / library_name(build_isa()) / "lock"
    first = ServerProcess("draft", ARGS, env=env).start(120)
    assert first.proc is not None
    started = time.monotonic()
    while not lock.exists():
        assert time.monotonic() - started < 120, "the build never took torch's lock"
        time.sleep(0.05)
    time.sleep(3.0)  # the compiler runs
    for pid in _tree(first.proc.pid):
        os.kill(pid, signal.SIGKILL)
    first.proc.kill()
    first.proc.wait()
    print(
        f"first start killed {time.monotonic() - started:.1f} s into its build; lock left: "
        f"{lock.exists()}"
    )
    seconds, output = _serving_after(env)
    print(f"second start: SERVING after {seconds:.1f} s")
    for line in output.splitlines():
        if "kernel" in line:
            print("   ", line.split(": ", 1)[-1])
    seconds, _ = _serving_after(env)
    print(f"third start (library built): SERVING after {seconds:.1f} s")


if __name__ == "__main__":
    main()
