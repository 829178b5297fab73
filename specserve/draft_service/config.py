"""The draft server's configuration: one frozen dataclass, built once from flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from specserve.engine.devices import check_device_name
from specserve.engine.draft_ahead import MAX_DRAFT_AHEAD
from specserve.engine.draft_vocab import DEFAULT_DRAFT_VOCAB
from specserve.engine.dtypes import DTYPES
from specserve.engine.model import DEFAULT_PREFILL_CHUNK_TOKENS
from specserve.serving.cli_args import (
    add_server_arguments,
    device_and_dtype,
    flag_values,
    server_options,
)
from specserve.serving.server import ServerOptions

DEFAULT_KV_BUDGET = "1GiB"
# bfloat16 weights: half the bytes of a draft step; the draft's precision never changes
# the output (on a CPU with the engine's kernels it computes in float32 anyway).
DEFAULT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class DraftServerConfig:
    """Everything a draft replica needs."""

    model: str | None  # None = n-gram drafting only
    device: str = "cpu"  # cpu, cuda or cuda:N (engine.devices)
    dtype: str = DEFAULT_DTYPE  # from flags: this on a CPU, bfloat16 on CUDA
    kv_budget_bytes: int = 1 << 30
    max_support: int = 64  # sparse q entries per sampled draft token
    min_confidence: float = 0.0  # stop drafting a session below this top probability
    draft_vocab: int = DEFAULT_DRAFT_VOCAB  # tokens the draft's head scores (0: all)
    # Ahead tokens per session drafted while the model is idle (engine.draft_ahead); 0 = off.
    # For a draft on its own device: on shared CPU cores it takes the target's CPU time.
    draft_ahead: int = 0
    fail_after_forwards: int | None = None  # testing: simulated device failure
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS  # 0: a prompt in one forward
    server: ServerOptions = field(default_factory=ServerOptions)
    # CUDA: greedy and coupled draft steps captured as CUDA graphs at start
    # (engine.step_runner); off, the same static steps are launched from the host.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        check_device_name(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 0 (0: off), got {self.prefill_chunk_tokens}"
            )
        if self.max_support < 1:
            raise ValueError(f"max_support must be >= 1, got {self.max_support}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 (0: all tokens), got {self.draft_vocab}")
        if not 0 <= self.min_confidence < 1:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if not 0 <= self.draft_ahead <= MAX_DRAFT_AHEAD:
            raise ValueError(
                f"draft_ahead must be in [0, {MAX_DRAFT_AHEAD}] (0: off), got {self.draft_ahead}"
            )
        if self.draft_ahead and self.model is None:
            raise ValueError(
                "draft_ahead needs a draft model (--model): an n-gram-only replica "
                "does not draft ahead"
            )


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    parser.add_argument(
        "--model",
        "--draft",
        dest="model",
        default=env.get("SPECSERVE_DRAFT"),
        help="draft model: store name, directory, GGUF file or tiny:<seed>[...]; "
        "omit for an n-gram-only replica",
    )
    parser.add_argument(
        "--max-support", type=int, default=64, help="sparse q entries per sampled draft token"
    )
    parser.add_argument(
        "--min-confidence",
        type=float,
        default=0.0,
        help="drop a draft whose top probability is below this and stop the session's "
        "round there, from a round's first draft on, for every session (adaptive "
        "sessions already stop where the product of their round's top probabilities "
        "falls below their policy's depth floor)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=env.get("SPECSERVE_DRAFT_VOCAB", str(DEFAULT_DRAFT_VOCAB)),
        metavar="N",
        help="the draft model's head scores only the N most frequent tokens (a smaller "
        "head read per draft step; never changes the output, docs/exactness.md); 0 = all",
    )
    parser.add_argument(
        "--draft-ahead",
        type=int,
        default=env.get("SPECSERVE_DRAFT_AHEAD", "0"),
        metavar="N",
        help="while idle, draft up to N tokens per session past its last proposal "
        "(the guess of the target's bonus token, then the next round's drafts); "
        "0 = off. For a draft on its own device: on shared CPU cores it takes the target's CPU",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="on CUDA, launch each draft step from the host instead of replaying the CUDA "
        "graphs captured at start",
    )
    add_server_arguments(parser, kv_budget=DEFAULT_KV_BUDGET, dtype=DEFAULT_DTYPE, env=env)


@flag_values("draft server")
def from_args(args: argparse.Namespace) -> DraftServerConfig:
    """The config of a draft server process, from its parsed flags; InvalidArgument for
    a device this machine lacks."""
    device, dtype = device_and_dtype(args, DEFAULT_DTYPE)
    return DraftServerConfig(
        model=args.model or None,
        device=device,
        dtype=dtype,
        kv_budget_bytes=args.kv_budget,
        max_support=args.max_support,
        min_confidence=args.min_confidence,
        draft_vocab=args.draft_vocab,
        draft_ahead=args.draft_ahead,
        fail_after_forwards=args.fail_after_forwards,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        server=server_options(args),
        cuda_graphs=args.cuda_graphs,
    )
