"""``specserve orchestrator``, ``specserve up``, and ``specserve generate`` against an orchestrator.

* ``orchestrator`` serves the public API over draft and target replicas;
* ``up`` starts a target server, a draft server and an orchestrator as child
  processes (embedded store, or ``--redis-url``; their flags and environment come
  from :mod:`specserve.cli_up`, which keeps secrets out of every command
  line and gives the replicas an internal token when TLS is off), prints where each listens,
  sends one example request and prints its text, tokens/s and acceptance; it
  stops them on Ctrl-C, SIGTERM and SIGHUP, and they stop themselves if it dies
  (:mod:`specserve.serving.supervision`);
* :func:`remote_generate` is what ``specserve generate`` (without ``--local``)
  runs: a streamed request to ``--orchestrator``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from specserve.cli_up import UpSettings, up_children
from specserve.engine.dtypes import DTYPE_NAMES
from specserve.engine.errors import InvalidArgument
from specserve.engine.model_spec import ModelSpec
from specserve.orchestrator.store.redis_settings import redacted
from specserve.serving.cli_args import add_pair_device_arguments, pair_placement
from specserve.serving.tls import ClientTls, client_tls

DEMO_TINY_PROMPT = [7, 21, 3, 7, 21, 3, 7, 21, 3, 9]


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``orchestrator`` and ``up`` to the ``specserve`` command's subparsers."""
    from specserve.orchestrator import config

    p = sub.add_parser(
        "orchestrator",
        help="run the orchestrator (public gRPC Generation API)",
        description="Serve Generate / GenerateStream / sessions over draft and target replicas.",
    )
    config.add_arguments(p)
    p.set_defaults(func=_run_orchestrator)

    p = sub.add_parser(
        "up",
        help="start a target, a draft and an orchestrator locally, and send one request",
        description="Start the whole stack as child processes on this machine (the demo model "
        "pair by default; `specserve models fetch demo` first), send one example request, and "
        "keep serving until Ctrl-C.",
    )
    p.add_argument("--target", default=None, help="target model (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft model (default: the demo draft)")
    p.add_argument("--tiny", action="store_true", help="tiny random models (no download)")
    add_pair_device_arguments(p)
    p.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_NAMES,
        help="the target's dtype (default float32 on a CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--draft-dtype",
        default=None,
        choices=DTYPE_NAMES,
        help="the draft's dtype (default bfloat16: on a CPU with the engine's kernels, "
        "bfloat16 weights under float32 compute, half the bytes of a draft step; the draft's "
        "precision never changes the output)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("SPECSERVE_REDIS_URL"),
        help="use this Redis instead of the embedded store (keep a password out of it: "
        "the command line is visible to every user; use --redis-password-file)",
    )
    p.add_argument(
        "--redis-password-file",
        default=os.environ.get("SPECSERVE_REDIS_PASSWORD_FILE"),
        metavar="FILE",
        help="the Redis password, handed to the orchestrator as this path (or set "
        "SPECSERVE_REDIS_PASSWORD, which the orchestrator inherits)",
    )
    p.add_argument(
        "--devices",
        choices=["shared", "separate"],
        default=os.environ.get("SPECSERVE_DEVICES"),
        help="declared to the orchestrator: every process here shares this machine's "
        "cores (shared, the default) unless they run on their own accelerators (separate, "
        "the default when --draft-device differs from --device)",
    )
    p.add_argument("--port", type=int, default=50051, help="the orchestrator's port")
    p.add_argument("--threads", type=int, default=None, help="torch threads per server")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--once", action="store_true", help="stop after the example request")
    g = p.add_argument_group("security (docs/security.md)")
    g.add_argument(
        "--tls-cert",
        help="certificate every server presents, and the orchestrator to the replicas "
        "(it must name 127.0.0.1 and allow server and client use)",
    )
    g.add_argument("--tls-key", help="its private key")
    g.add_argument("--tls-ca", help="the CA that signed it: turns on (mutual) TLS everywhere")
    g.add_argument(
        "--api-keys-file",
        help="the orchestrator's API keys; the example request sends SPECSERVE_API_KEY",
    )
    p.set_defaults(func=_run_up)


def _run_orchestrator(args: argparse.Namespace) -> int:
    from specserve.orchestrator import app, config

    return app.run(config.from_args(args))


def _prompt_arg(prompt: str, chat: bool) -> object:
    """Chat messages, token ids (a prompt of integers only), or text."""
    if chat:
        return [{"role": "user", "content": prompt}]
    words = prompt.split()
    if words and all(w.lstrip("-").isdigit() for w in words):
        return [int(w) for w in words]
    return prompt


def _print_summary(label: str, deltas: list, seconds: float) -> None:  # type: ignore[type-arg]
    last = deltas[-1]
    tokens = sum(len(d.token_ids) for d in deltas)
    u = last.usage
    print(
        f"{label}: {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.2f} tok/s | "
        f"{u.rounds} rounds | acceptance {100 * u.acceptance_rate:.1f}% | mean acceptance "
        f"length {u.mean_acceptance_length:.2f} | finish {last.finish_reason}"
    )


def _stream(
    address: str,
    prompt: object,
    show_prompt: str,
    *,
    tls: ClientTls | None = None,
    api_key: str | None = None,
    **kwargs: object,
) -> int:
    import grpc

    from specserve.client import Client

    with Client(address, tls=tls, api_key=api_key) as client:
        print(show_prompt, end="", flush=True)
        t0 = time.perf_counter()
        deltas = []
        try:
            for d in client.stream(prompt, **kwargs):  # type: ignore[arg-type]
                print(d.text, end="", flush=True)
                deltas.append(d)
        except grpc.RpcError as e:
            print(f"\nspecserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        print()
        _print_summary("speculative", deltas, time.perf_counter() - t0)
    return 0


def remote_generate(args: argparse.Namespace, prompt: str) -> int:
    """``specserve generate`` against a running orchestrator (``--orchestrator``)."""
    from specserve.cli_generate import api_key_of

    return _stream(
        args.orchestrator,
        _prompt_arg(prompt, args.chat),
        prompt,
        tls=client_tls(args),
        api_key=api_key_of(args),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=args.stop,
        drafter=args.drafter,
        k=args.k,
        rule=args.rule,
        skip_special_tokens=not args.keep_special_tokens,
    )


def _run_up(args: argparse.Namespace) -> int:
    """Start the stack, send the example request, serve until stopped.

    Returns 0 after Ctrl-C or ``--once``, 1 when a server exited or the request
    failed; SIGTERM and SIGHUP raise :class:`~specserve.serving.supervision.StopSignal`
    out of it (``specserve``'s exit code 128 + the signal), after the children stopped.
    """
    from specserve.serving.supervision import stop_on_signals

    with stop_on_signals():
        return _up(args)


def _up(args: argparse.Namespace) -> int:
    from specserve.cli_generate import DEMO_DRAFT, DEMO_PROMPT, DEMO_TARGET
    from specserve.orchestrator.launch import OrchestratorProcess
    from specserve.serving.launch import ServerProcess, stop_all

    if args.tiny:
        target, draft = args.target or "tiny:3", args.draft or "tiny:3:noise=0.3"
    else:
        target, draft = args.target or DEMO_TARGET, args.draft or DEMO_DRAFT
    specs = [ModelSpec.parse(target), ModelSpec.parse(draft)]  # malformed: refused here
    if not (specs[0].is_tiny and specs[1].is_tiny):  # a few seconds on GGUF tokenizers
        print("checking the models and their tokenizers ...", flush=True)
    _check_pair(specs[0], specs[1])
    at = pair_placement(args.device, args.draft_device, args.dtype, args.draft_dtype)
    tls_args, tls = _up_tls(args)
    api_key = os.environ.get("SPECSERVE_API_KEY")
    if args.api_keys_file and not api_key:
        raise InvalidArgument(
            "specserve up --api-keys-file sends its example request with the key in "
            "SPECSERVE_API_KEY: set it to one of the file's keys"
        )
    if args.redis_password_file and not os.path.isfile(args.redis_password_file):
        raise InvalidArgument(f"--redis-password-file {args.redis_password_file!r} is not a file")
    run_dir = tempfile.TemporaryDirectory(prefix="specserve-up-")  # mode 700
    settings = UpSettings(
        target,
        draft,
        at,
        threads=args.threads,
        tls_args=tuple(tls_args),
        devices=args.devices,
        api_keys_file=args.api_keys_file,
        redis_url=args.redis_url,
        redis_password_file=args.redis_password_file,
    )
    children = up_children(settings, Path(run_dir.name))
    for warning in children.warnings:
        print(f"specserve up: WARNING: {warning}", file=sys.stderr)
    servers = [
        ServerProcess("target", children.target_args, tls=tls),
        ServerProcess("draft", children.draft_args, tls=tls),
    ]
    orchestrator: OrchestratorProcess | None = None
    try:
        for s in servers:
            s.start()
        where = ["--target", servers[0].address, "--draft", servers[1].address]
        orchestrator = OrchestratorProcess(
            [*where, *children.orchestrator_args],
            port=args.port,
            env=children.orchestrator_env,
            tls=tls,
        )
        orchestrator.start()
        print(
            f"target {target} ({at.target_device}) on {servers[0].address}, "
            f"draft {draft} ({at.draft_device}) on {servers[1].address}"
        )
        print("loading models ...", flush=True)
        for s in (*servers, orchestrator):
            s.wait_serving(timeout_s=900)
        store = redacted(args.redis_url) if args.redis_url else "embedded store"
        print(f"orchestrator on {orchestrator.address} (sessions in {store})")
        tiny = specs[0].is_tiny
        prompt: object = DEMO_TINY_PROMPT if tiny else DEMO_PROMPT
        shown = " ".join(map(str, DEMO_TINY_PROMPT)) if tiny else DEMO_PROMPT
        code = _stream(
            orchestrator.address,
            prompt,
            shown,
            tls=tls,
            api_key=api_key,
            max_new_tokens=args.max_new_tokens,
        )
        if args.once or code:
            return code
        print(
            f"serving; try: specserve generate --orchestrator {orchestrator.address} "
            "'def add(a, b):'   (Ctrl-C or SIGTERM stops everything)"
        )
        while all(s.proc is not None and s.proc.poll() is None for s in (*servers, orchestrator)):
            time.sleep(0.5)
        print(
            "a server exited:\n" + "\n".join(s.output()[-2000:] for s in servers), file=sys.stderr
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_all([orchestrator, *servers])
        run_dir.cleanup()


def _check_pair(target: ModelSpec, draft: ModelSpec) -> None:
    """Refuse, before anything starts, a model that is not fetched (NotFound says how to
    fetch it), that the engine will not load (the loader's sentence), or a draft whose
    tokenizer is not its target's (:func:`~specserve.engine.model_check.pair_problem`);
    from configs, headers and tokenizers only."""
    from specserve.engine.errors import ModelLoadError
    from specserve.engine.model_check import inspect_model, pair_problem
    from specserve.model_store import resolve

    facts = [inspect_model(s, None if s.is_tiny else resolve(s.source)) for s in (target, draft)]
    problem = pair_problem(facts[1], facts[0])
    if problem is not None:
        raise ModelLoadError(problem)


def _up_tls(args: argparse.Namespace) -> tuple[list[str], ClientTls | None]:
    """The TLS flags ``up`` passes to every server, and how it reaches them itself."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return [], None
    if not all(given):
        raise InvalidArgument("specserve up takes --tls-cert, --tls-key and --tls-ca together")
    flags = ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key, "--tls-ca", args.tls_ca]
    return flags, ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
