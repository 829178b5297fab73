"""The target server's configuration: one frozen dataclass, built once from flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from specserve.engine.devices import check_device_name
from specserve.engine.dtypes import DTYPES
from specserve.engine.model import DEFAULT_PREFILL_CHUNK_TOKENS
from specserve.serving.cli_args import (
    add_server_arguments,
    device_and_dtype,
    flag_values,
    server_options,
)
from specserve.serving.server import ServerOptions
from specserve.target_service.tp_config import (
    TPSettings,
    add_tp_arguments,
    for_device,
    tp_settings,
)

DEFAULT_KV_BUDGET = "2GiB"
DEFAULT_DTYPE = "float32"  # on a CPU; bfloat16 on CUDA


@dataclass(frozen=True)
class TargetServerConfig:
    """Everything a target replica needs."""

    model: str
    device: str = "cpu"  # cpu, cuda or cuda:N (engine.devices); TP ranks: cuda:<local rank>
    dtype: str = DEFAULT_DTYPE  # from flags: this on a CPU, bfloat16 on CUDA
    kv_budget_bytes: int = 2 << 30
    fail_after_forwards: int | None = None  # testing: simulated device failure
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS  # 0: a prompt in one forward
    server: ServerOptions = field(default_factory=ServerOptions)
    tp: TPSettings = field(default_factory=TPSettings)  # world_size 1: no tensor parallelism
    # CUDA: decode/verify steps captured as CUDA graphs at start (engine.step_runner); off,
    # the same static steps are launched from the host.
    cuda_graphs: bool = True
    batch_invariant: bool = False  # CUDA: every step in the (k_max + 1)-token bucket

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a target server needs a model (--model)")
        check_device_name(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 0 (0: off), got {self.prefill_chunk_tokens}"
            )


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The target server's flags: the model, the shared serving flags and the TP flags."""
    env = os.environ if env is None else env
    parser.add_argument(
        "--model",
        "--target",
        dest="model",
        default=env.get("SPECSERVE_TARGET"),
        required=not env.get("SPECSERVE_TARGET"),
        help="target model: store name, directory, GGUF file or tiny:<seed>[...]",
    )
    add_server_arguments(parser, kv_budget=DEFAULT_KV_BUDGET, dtype=DEFAULT_DTYPE, env=env)
    g = parser.add_argument_group("CUDA steps")
    g.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, launch each decode/verify step from the host instead of replaying the "
        "CUDA graphs captured at start (capture takes seconds and device memory)",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="on CUDA, run every decode/verify step in the (k_max + 1)-token graph, so a "
        "verified row gets the bits of a one-token step (greedy speculation == target-only "
        "in bfloat16)",
    )
    add_tp_arguments(parser, env)


@flag_values("target server")
def from_args(args: argparse.Namespace) -> TargetServerConfig:
    """The one config of a target server process, from its parsed flags; InvalidArgument
    for a device this machine lacks (Ray ranks: checked where they run) or a TP backend
    the device contradicts."""
    tp = tp_settings(args, num_threads=args.threads)
    ray = tp.world_size > 1 and tp.launcher == "ray"
    device, dtype = device_and_dtype(args, DEFAULT_DTYPE, check_machine=not ray)
    return TargetServerConfig(
        model=args.model,
        device=device,
        dtype=dtype,
        kv_budget_bytes=args.kv_budget,
        fail_after_forwards=args.fail_after_forwards,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        server=server_options(args),
        tp=for_device(tp, device),
        cuda_graphs=args.cuda_graphs,
        batch_invariant=args.batch_invariant,
    )
