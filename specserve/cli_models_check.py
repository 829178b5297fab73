"""``specserve models check``: will a model (and a draft/target pair) load, at what cost.

One screen per call, from configs, tensor headers and tokenizers only
(:mod:`specserve.engine.model_check`): the family, parameters, weight format and
types, resident weights and the KV cache per token and per full context, then
``will load`` or ``will not load: <the loader's sentence>``; with ``--draft``, the same
for the draft and the pair rule (one tokenizer). Exit status 0 when everything
checked will load, 1 when something will not, 2 for a malformed spec or flag.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve import model_store
from specserve.engine.dtypes import DTYPE_NAMES, parse_dtype
from specserve.engine.errors import EngineError, InvalidArgument
from specserve.engine.model_check import ModelFacts, inspect_model, pair_problem
from specserve.engine.model_spec import ModelSpec

TARGET_DTYPE = "float32"  # the target server's default weight dtype on a CPU
DRAFT_DTYPE = "bfloat16"  # the draft server's


def add_check_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``check`` to the ``models`` subcommands."""
    p = sub.add_parser(
        "check",
        help="say whether a model (and a draft/target pair) will load, and its memory",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "model",
        metavar="PATH_OR_SPEC",
        help="a model directory, GGUF file, "
        "store name or tiny:<seed> spec (the target, with --draft)",
    )
    p.add_argument("--draft", default=None, metavar="PATH_OR_SPEC", help="a draft for it")
    p.add_argument(
        "--dtype",
        default=TARGET_DTYPE,
        choices=DTYPE_NAMES,
        help=f"the model's weight dtype (default {TARGET_DTYPE})",
    )
    p.add_argument(
        "--draft-dtype",
        default=DRAFT_DTYPE,
        choices=DTYPE_NAMES,
        help=f"the draft's weight dtype (default {DRAFT_DTYPE})",
    )


def run_check(args: argparse.Namespace, home: Path) -> int:
    """Print the report; 0: all will load, 1: something will not, 2: a malformed spec."""
    try:
        specs = [(ModelSpec.parse(args.model), args.dtype, "model" if not args.draft else "target")]
        if args.draft:
            specs.append((ModelSpec.parse(args.draft), args.draft_dtype, "draft"))
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    found: dict[str, ModelFacts] = {}
    for spec, dtype, role in specs:
        print(f"{role}: {spec}")
        try:
            path = None if spec.is_tiny else model_store.resolve(spec.source, home)
            facts = inspect_model(spec, path, parse_dtype(dtype))
        except EngineError as exc:
            print(f"  will not load: {exc}")
            continue
        for line in describe(facts, dtype):
            print(f"  {line}")
        print("  will load")
        found[role] = facts
    if len(found) != len(specs):
        return 1
    if args.draft:
        try:
            problem = pair_problem(found["draft"], found["target"])
        except EngineError as exc:
            problem = str(exc)
        if problem is not None:
            print(f"pair: will not load: {problem}")
            return 1
        print("pair: one tokenizer; will load as a pair")
    return 0


def describe(facts: ModelFacts, dtype: str) -> list[str]:
    """The report's lines about one model that will load."""
    cfg = facts.config
    types = ", ".join(f"{n} {name}" for name, n in sorted(facts.tensor_types.items()))
    where = f" ({_bytes(facts.file_bytes)} of tensors)" if facts.file_bytes else ""
    held = f"the {facts.weight_form} form, other tensors in {dtype}" if facts.weight_form else dtype
    per_token = facts.kv_bytes_per_token
    context = cfg.max_position_embeddings
    return [
        f"family {cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
        f"vocabulary {cfg.vocab_size}, context {context}",
        f"parameters {facts.parameters / 1e6:,.1f} M{_experts(facts)}",
        f"weights {facts.weight_format}: {types}{where}",
        f"memory: weights {_bytes(facts.resident_bytes)} resident ({held}); KV cache "
        f"{_bytes(per_token)} per token (float32), {_bytes(per_token * context)} for one "
        f"full {context}-token context",
    ]


def _experts(facts: ModelFacts) -> str:
    """What a mixture of experts adds to the parameters line (nothing for a dense model)."""
    cfg = facts.config
    if not cfg.num_experts:
        return ""
    return (
        f" (every expert; {facts.active_parameters / 1e6:,.1f} M active per token: "
        f"{cfg.num_experts_per_tok} of {cfg.num_experts} experts of "
        f"{cfg.expert_intermediate_size} a layer)"
    )


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
