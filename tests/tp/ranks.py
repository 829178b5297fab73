"""Start a TP group as torchrun would: N spawned processes, the torchrun environment each.

Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free
MASTER_PORT, with gloo pinned to the loopback interface, so the group never leaves
this machine; each then calls ``program(rank, world_size, *args)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def _entry(program: Callable[..., None], rank: int, world: int, port: int, args: tuple) -> None:
    os.environ.update(torchrun_env(rank, world, port))
    import torch

    torch.set_num_threads(1)
    program(rank, world, *args)


def run_ranks(
    program: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 90.0
) -> list[int | None]:
    """Run ``program`` on ``world_size`` ranks; return their exit codes (None: timed out)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(program, rank, world_size, port, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes
