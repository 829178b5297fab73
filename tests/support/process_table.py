"""The process table as the tests read it (Linux ``/proc``): who descends from whom,
and whether a process is still there.

A process is identified by (pid, start time), so a pid the kernel reuses after the
process exited is not taken for it. A zombie (exited, not yet reaped by whoever
adopted it) counts as gone: it holds no memory, port or file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Proc:
    """One process: its pid, its start time (clock ticks since boot) and command line."""

    pid: int
    started: int
    cmdline: str


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``, or None if there is no such process."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ..." where comm may hold spaces and parentheses.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def descendants(pid: int) -> list[Proc]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents.setdefault(stat[1], []).append(int(entry.name))
    found: list[Proc] = []
    todo = list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        stat = _stat(child)
        if stat is not None and stat[0] != "Z":
            found.append(Proc(child, stat[2], _cmdline(child)))
        todo.extend(parents.get(child, []))
    return found


def alive(proc: Proc) -> bool:
    """Whether ``proc`` still runs (not exited, not a zombie, its pid not reused)."""
    stat = _stat(proc.pid)
    return stat is not None and stat[0] != "Z" and stat[2] == proc.started


def wait_gone(procs: list[Proc], timeout_s: float) -> list[Proc]:
    """Wait up to ``timeout_s`` for every process to end; those still alive."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def ignored_signals(pid: int) -> int:
    """The mask of signals ``pid`` ignores (bit n - 1 for signal n)."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")
