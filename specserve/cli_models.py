"""``specserve models``: fetch, list and locate the models of the local store; check one.

Wire into the main CLI with :func:`add_parser`; each subcommand's handler
returns the exit status. Bad input prints one sentence on stderr and exits
non-zero, never a traceback. Also runnable alone:
``python -m specserve.cli_models fetch demo``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specserve import model_store
from specserve.cli_models_check import add_check_parser, run_check
from specserve.engine.errors import EngineError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``models`` command (fetch / list / path / check) to a subparsers object."""
    parser = subparsers.add_parser(
        "models", help="fetch and list the local model store; check that a model will load"
    )
    _configure(parser)
    return parser


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home",
        type=Path,
        default=None,
        help="store directory (default: $SPECSERVE_HOME or ~/.cache/specserve)",
    )
    parser.set_defaults(func=run)
    sub = parser.add_subparsers(dest="models_command", metavar="{fetch,list,path,check}")
    sub.required = True
    groups = ", ".join(model_store.GROUPS)
    fetch = sub.add_parser("fetch", help="download and verify models (kept as GGUF)")
    fetch.add_argument(
        "targets",
        nargs="*",
        default=["demo"],
        metavar="NAME",
        help=f"a group ({groups}) or a model name; default: demo",
    )
    fetch.add_argument("--quiet", action="store_true", help="no progress bars")
    sub.add_parser("list", help="show which models are present and their sizes")
    path = sub.add_parser("path", help="print the GGUF file of a fetched model")
    path.add_argument("name", help="model name, e.g. qwen2.5-coder-1.5b-instruct")
    add_check_parser(sub)


def run(args: argparse.Namespace) -> int:
    """Handler of ``specserve models``: dispatch and turn errors into one stderr line."""
    home: Path = (args.home or model_store.default_home()).expanduser()
    try:
        if args.models_command == "fetch":
            return _fetch(args.targets, home, progress=not args.quiet)
        if args.models_command == "list":
            return _list(home)
        if args.models_command == "check":
            return run_check(args, home)
        print(model_store.resolve(args.name, home))
        return 0
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = exc.filename or home
        print(f"error: cannot use {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130


def _fetch(targets: list[str], home: Path, progress: bool) -> int:
    specs = model_store.expand(targets)
    changed = [model_store.fetch(spec, home, progress=progress) for spec in specs]
    if not any(changed):
        print(f"nothing to do: {', '.join(s.name for s in specs)} already present under {home}")
    return 0


def _list(home: Path) -> int:
    entries = model_store.list_models(home)
    width = max(len(e.spec.name) for e in entries)
    print(f"store: {home}")
    for e in entries:
        state = "present" if e.present else "absent"
        size = f"{e.bytes_on_disk / 1e9:6.2f} GB" if e.bytes_on_disk else "      -"
        print(f"{e.spec.name:<{width}}  {e.spec.role:<16}  {state:<7}  {size}  {e.spec.title}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``models`` as a standalone program (``python -m specserve.cli_models``)."""
    parser = argparse.ArgumentParser(prog="specserve models", description=__doc__.splitlines()[0])
    _configure(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
