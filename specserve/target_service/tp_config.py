"""Tensor-parallel settings of the target server: one frozen dataclass and its flags.

========================  ==============================  ==========================
flag                      environment                     default
========================  ==============================  ==========================
``--tp``                  ``SPECSERVE_TP``                1 (no tensor parallelism)
``--tp-launcher``         ``SPECSERVE_TP_LAUNCHER``       torchrun
``--tp-backend``          ``SPECSERVE_TP_BACKEND``        nccl on ``--device cuda``, else gloo
``--tp-timeout-s``        ``SPECSERVE_TP_TIMEOUT_S``      30
``--ray-address``         ``RAY_ADDRESS``                 latest local cluster, or new
``--ray-strategy``        ``SPECSERVE_RAY_STRATEGY``      PACK
========================  ==============================  ==========================

The environment is read while the parser is built and nowhere deeper, except for
torchrun's own contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``),
which :mod:`specserve.target_service.tp_worker` reads when it joins the group.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from specserve.engine.devices import is_cuda
from specserve.engine.errors import InvalidArgument
from specserve.engine.tp import BACKENDS, DEFAULT_TIMEOUT_S

LAUNCHERS = ("torchrun", "ray")
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class TPSettings:
    """How the target is split and launched; built once from CLI flags."""

    world_size: int = 1
    launcher: str = "torchrun"
    backend: str | None = None  # None: what the server's --device implies (for_device)
    timeout_s: float = DEFAULT_TIMEOUT_S  # every collective; a dead rank surfaces within it
    ray_address: str | None = None  # None: RAY_ADDRESS, a running local cluster, or a new one
    ray_strategy: str = "PACK"  # placement group strategy; STRICT_SPREAD: one rank per node
    num_threads: int | None = None  # torch intra-op threads per rank (None: torch's default)
    start_timeout_s: float = 600.0  # Ray: placing the actors and loading the model

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InvalidArgument(f"--tp must be >= 1, got {self.world_size}")
        if self.launcher not in LAUNCHERS:
            raise InvalidArgument(
                f"unknown TP launcher {self.launcher!r}; choose from {', '.join(LAUNCHERS)}"
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise InvalidArgument(
                f"unknown TP backend {self.backend!r}; choose from {', '.join(BACKENDS)}"
            )
        if self.ray_strategy not in RAY_STRATEGIES:
            raise InvalidArgument(
                f"unknown Ray placement strategy {self.ray_strategy!r}; "
                f"choose from {', '.join(RAY_STRATEGIES)}"
            )
        if not self.timeout_s > 0 or not self.start_timeout_s > 0:
            raise InvalidArgument("TP timeouts must be positive")


def add_tp_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Add the tensor-parallel flags (see the module doc) to a target server's parser."""
    env = os.environ if env is None else env
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument(
        "--tp",
        type=int,
        default=int(env.get("SPECSERVE_TP", "1")),
        help="split the target over this many ranks (torchrun: --nproc-per-node must match)",
    )
    g.add_argument(
        "--tp-launcher",
        choices=LAUNCHERS,
        default=env.get("SPECSERVE_TP_LAUNCHER", "torchrun"),
        help="torchrun: every rank runs this command; ray: this process starts one actor per rank",
    )
    g.add_argument(
        "--tp-backend",
        choices=BACKENDS,
        default=env.get("SPECSERVE_TP_BACKEND"),
        help="collectives: nccl (ranks on cuda:<local rank>, --device cuda) or gloo "
        "(ranks on the CPU, --device cpu); default: the one --device implies",
    )
    g.add_argument(
        "--tp-timeout-s",
        type=float,
        default=float(env.get("SPECSERVE_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
        help="collective timeout: a dead or stuck rank makes rank 0 fail within it",
    )
    g.add_argument(
        "--ray-address",
        default=env.get("RAY_ADDRESS"),
        help="Ray cluster to join with --tp-launcher ray, HOST:PORT (default: the local "
        "cluster started last, else a new local one)",
    )
    g.add_argument(
        "--ray-strategy",
        choices=RAY_STRATEGIES,
        default=env.get("SPECSERVE_RAY_STRATEGY", "PACK"),
        help="placement group strategy for the rank actors",
    )


def tp_settings(args: argparse.Namespace, num_threads: int | None = None) -> TPSettings:
    """The :class:`TPSettings` of parsed flags (``num_threads``: the server's ``--threads``)."""
    return TPSettings(
        world_size=args.tp,
        launcher=args.tp_launcher,
        backend=args.tp_backend,
        timeout_s=args.tp_timeout_s,
        ray_address=args.ray_address,
        ray_strategy=args.ray_strategy,
        num_threads=num_threads,
    )


def for_device(settings: TPSettings, device: str) -> TPSettings:
    """``settings`` with the collective backend the server's ``device`` implies: NCCL
    ranks compute on ``cuda:<local rank>``, gloo ranks on the CPU. InvalidArgument where
    ``--tp-backend`` contradicts ``--device``, or names one CUDA index for several ranks.
    A single process (``--tp 1``) keeps its backend setting (it joins no group)."""
    cuda = is_cuda(device)
    if settings.world_size == 1:
        return settings
    if device not in ("cpu", "cuda"):
        raise InvalidArgument(
            f"--device {device} with --tp {settings.world_size}: each rank takes "
            "cuda:<its local rank>; pass --device cuda"
        )
    implied = "nccl" if cuda else "gloo"
    if settings.backend not in (None, implied):
        raise InvalidArgument(
            f"--tp-backend {settings.backend} contradicts --device {device}: "
            f"{settings.backend} ranks compute on "
            f"{'CUDA' if settings.backend == 'nccl' else 'the CPU'}; pass "
            f"--device {'cuda' if settings.backend == 'nccl' else 'cpu'} or --tp-backend {implied}"
        )
    return dataclasses.replace(settings, backend=implied)


def torchrun_rank() -> int:
    """This process's rank as torchrun set it (0 when not started by torchrun)."""
    return int(os.environ.get("RANK", "0"))  # torchrun's contract is the environment


def is_torchrun(settings: TPSettings) -> bool:
    """True in a rank of a torchrun group (any rank, 0 included)."""
    return settings.world_size > 1 and settings.launcher == "torchrun"


def is_torchrun_worker(settings: TPSettings) -> bool:
    """True in a torchrun process of rank > 0: it serves as a worker and binds no gRPC port."""
    return is_torchrun(settings) and torchrun_rank() != 0
