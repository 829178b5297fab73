"""``torchrun --nproc-per-node 2 -m tests.tp.torchrun_program OUT``: the greedy case,
each rank reading its place in the group from the environment torchrun set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.tp import programs

if __name__ == "__main__":
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    programs.greedy_program(rank, world, Path(sys.argv[1]), *programs.GREEDY_CASE.values(), 20.0)
