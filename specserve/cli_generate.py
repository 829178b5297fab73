"""``specserve generate``: one completion, locally (``--local``) or from an orchestrator."""

from __future__ import annotations

import argparse
import os
import sys

from specserve.engine.drafter import DrafterKind
from specserve.engine.dtypes import DTYPE_NAMES
from specserve.engine.errors import InvalidArgument
from specserve.engine.sampling import SamplingParams, SamplingRule
from specserve.serving.cli_args import add_pair_device_arguments, pair_placement

DEMO_TARGET = "qwen2.5-coder-1.5b-instruct"
DEMO_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEMO_PROMPT = (
    "def quicksort(items: list[int]) -> list[int]:\n"
    '    """Sort a list of integers with quicksort and return a new list."""\n'
)


def parse_k(value: str) -> int | None:
    """``auto`` (adaptive) or a number of draft tokens per round."""
    if value == "auto":
        return None
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"k must be a number or 'auto', got {value!r}") from None
    if not 0 <= k <= 16:
        raise argparse.ArgumentTypeError(f"k must be between 0 and 16, got {k}")
    return k


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="generate a completion",
        description="Generate a completion with speculative decoding. With --local the "
        "models run in this process; otherwise the request goes to an orchestrator.",
    )
    p.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin)")
    p.add_argument("--local", action="store_true", help="run the models in this process")
    p.add_argument("--demo", action="store_true", help=f"local demo: {DEMO_TARGET} + {DEMO_DRAFT}")
    p.add_argument("--target", default=os.environ.get("SPECSERVE_TARGET"), help="target model")
    p.add_argument("--draft", default=os.environ.get("SPECSERVE_DRAFT"), help="draft model")
    add_pair_device_arguments(p)
    p.add_argument(
        "--target-dtype",
        default=None,
        choices=DTYPE_NAMES,
        help="default float32 on a CPU, bfloat16 on CUDA",
    )
    p.add_argument(
        "--draft-dtype",
        default=None,
        choices=DTYPE_NAMES,
        help="default bfloat16: on a CPU with the engine's kernels, bfloat16 weights under "
        "float32 compute (half the bytes of a draft step); the output does not depend on it",
    )
    p.add_argument(
        "--drafter", type=DrafterKind, default=DrafterKind.MODEL, choices=list(DrafterKind)
    )
    p.add_argument("-k", type=parse_k, default=None, help="draft tokens per round, or 'auto'")
    p.add_argument("--k-max", type=int, default=8, help="largest k the adaptive policy picks")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rule",
        default=SamplingRule.COUPLED.value,
        choices=[r.value for r in SamplingRule],
        help="sampling rule when temperature > 0: coupled (tokens depend on the seed "
        "alone, as target-only sampling) or rejection (docs/sampling.md)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="render the prompt with the chat template")
    p.add_argument(
        "--keep-special-tokens",
        action="store_true",
        help="print special tokens such as <|im_end|> (left out of the text by default)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also decode target-only and report the speedup and whether outputs match",
    )
    p.add_argument(
        "--orchestrator", default=os.environ.get("SPECSERVE_ORCHESTRATOR", "127.0.0.1:50051")
    )
    add_client_security_arguments(p)
    p.set_defaults(func=run)


def add_client_security_arguments(p: argparse.ArgumentParser) -> None:
    """TLS towards the orchestrator and the API key: ``--api-key-file`` or
    ``SPECSERVE_API_KEY`` (a key is never a flag: flags show in the process list)."""
    from specserve.serving.tls import add_tls_arguments

    add_tls_arguments(p, os.environ, role="client")
    p.add_argument(
        "--api-key-file",
        default=os.environ.get("SPECSERVE_API_KEY_FILE"),
        metavar="FILE",
        help="file holding the API key sent to the orchestrator (or set SPECSERVE_API_KEY)",
    )
    p.set_defaults(api_key_env=os.environ.get("SPECSERVE_API_KEY"))


def api_key_of(args: argparse.Namespace) -> str | None:
    """The API key from --api-key-file, else SPECSERVE_API_KEY (None: send none)."""
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise InvalidArgument(
                f"cannot read --api-key-file {args.api_key_file!r}: {e.strerror}"
            ) from None
        if not key or len(key.split()) != 1:
            raise InvalidArgument(f"--api-key-file {args.api_key_file!r} must hold one key")
        return key
    return args.api_key_env or None


def run(args: argparse.Namespace) -> int:
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if args.demo:
        args.local = True
        args.target = args.target or DEMO_TARGET
        args.draft = args.draft or DEMO_DRAFT
        prompt = prompt or DEMO_PROMPT
    if not prompt:
        raise InvalidArgument("give a prompt (or '-' to read it from stdin)")
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        rule=SamplingRule(args.rule),
    )
    if not args.local:
        from specserve.cli_orchestrator import remote_generate

        return remote_generate(args, prompt)
    return _run_local(args, prompt, params)


def _run_local(args: argparse.Namespace, prompt: str, params: SamplingParams) -> int:
    from specserve.local import LocalConfig, LocalRunner

    if not args.target:
        raise InvalidArgument("--local needs --target (or use --demo)")
    if args.drafter == DrafterKind.MODEL and not args.draft:
        raise InvalidArgument("--drafter model needs --draft (or use --drafter ngram)")
    at = pair_placement(args.device, args.draft_device, args.target_dtype, args.draft_dtype)
    print(
        f"loading target {args.target} ({at.target_dtype}, {at.target_device})"
        + (f" and draft {args.draft} ({at.draft_dtype}, {at.draft_device})" if args.draft else ""),
        file=sys.stderr,
    )
    runner = LocalRunner(
        LocalConfig(
            target=args.target,
            draft=args.draft if args.drafter == DrafterKind.MODEL else None,
            target_dtype=at.target_dtype,
            draft_dtype=at.draft_dtype,
            target_device=at.target_device,
            draft_device=at.draft_device,
            threads=args.threads,
        )
    )
    ids = _encode(runner, prompt, args.chat)
    common = {
        "max_new_tokens": args.max_new_tokens,
        "stop": args.stop,
        "skip_special_tokens": not args.keep_special_tokens,
    }
    # Warm-up outside the timing: the first forward pays one-off allocation costs.
    runner.generate(ids[-8:], params, max_new_tokens=2, drafter=DrafterKind.NONE)
    print(prompt, end="", flush=True)
    spec = runner.generate(
        ids,
        params,
        drafter=args.drafter,
        k=args.k,
        k_max=args.k_max,
        on_text=lambda t: print(t, end="", flush=True),
        **common,
    )
    print()
    print(
        f"speculative ({args.drafter}, k={'auto' if args.k is None else args.k}): " + spec.summary()
    )
    if args.compare:
        plain = runner.generate(ids, params, drafter=DrafterKind.NONE, **common)
        print("target only: " + plain.summary())
        same = plain.tokens == spec.tokens
        print(
            f"speedup {spec.tokens_per_second / plain.tokens_per_second:.2f}x; "
            f"outputs {'identical' if same else 'DIFFER'}"
        )
        if params.greedy and not same and at.target_dtype == "float32":
            return 1
    return 0


def _encode(runner: object, prompt: str, chat: bool) -> list[int]:
    tok = runner.tokenizer  # type: ignore[attr-defined]
    if tok is None:
        try:
            return [int(t) for t in prompt.split()]
        except ValueError:
            raise InvalidArgument("a tiny test model takes token ids: '1 2 3'") from None
    if chat:
        return list(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    return list(tok.encode(prompt))
