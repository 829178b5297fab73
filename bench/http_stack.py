"""A whole stack with the OpenAI HTTP server in front, for the HTTP benchmarks.

Target and draft servers, an orchestrator (embedded session store) and
``specserve http-server`` as child processes on loopback, started as ``specserve up``
starts them. Tiny models (``tiny:...``) get the 256-id tiny tokenizer, so text
prompts, chat and load generators that count tokens work on them too; a real pair
uses the target's own tokenizer.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specserve.engine.model_spec import ModelSpec
from specserve.engine.tiny_tokenizer import write_tiny_tokenizer
from specserve.openai_api.launch import HttpServerProcess
from specserve.orchestrator.launch import OrchestratorProcess
from specserve.serving.launch import ServerProcess

TINY_TARGET = "tiny:3"
TINY_DRAFT = "tiny:3:noise=0.3"
MODEL_NAME = "specserve"


@dataclass
class HttpStack:
    target: ServerProcess
    draft: ServerProcess
    orchestrator: OrchestratorProcess
    http: HttpServerProcess
    tokenizer: str  # a directory (tiny) or the target's model spec

    @property
    def base_url(self) -> str:
        return self.http.base_url


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=TINY_TARGET, help="target model (store name, dir, tiny:)")
    p.add_argument("--draft", default=TINY_DRAFT, help="draft model (same tokenizer)")
    p.add_argument("--target-dtype", default="float32")
    p.add_argument("--draft-dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per server")
    p.add_argument("--kv-budget", default="256MiB", help="each server's KV budget")


@contextmanager
def http_stack(args: argparse.Namespace) -> Iterator[HttpStack]:
    """Start everything, wait until /health answers 200, stop everything at the end."""
    with tempfile.TemporaryDirectory(prefix="specserve-bench-") as tmp:
        tiny = ModelSpec.parse(args.target).is_tiny
        tokenizer = str(write_tiny_tokenizer(Path(tmp) / "tok")) if tiny else args.target
        common = ["--threads", str(args.threads), "--kv-budget", args.kv_budget]
        target = ServerProcess(
            "target", ["--model", args.target, "--dtype", args.target_dtype, *common]
        )
        draft = ServerProcess(
            "draft", ["--model", args.draft, "--dtype", args.draft_dtype, *common]
        )
        procs: list[ServerProcess] = [target, draft]
        try:
            for s in (target, draft):
                s.start()
            orchestrator = OrchestratorProcess(
                [
                    *("--target", target.address, "--draft", draft.address),
                    *("--tokenizer", tokenizer, "--served-model-name", MODEL_NAME),
                    # One token per streamed message, as the HTTP benchmarks time them
                    # (and as `specserve up` on shared cores decodes plain rounds).
                    *("--plain-steps", "1"),
                ]
            )
            procs.append(orchestrator.start())
            for s in (target, draft, orchestrator):
                s.wait_serving(timeout_s=900)
            http = HttpServerProcess(orchestrator.address, ["--served-model-name", MODEL_NAME])
            procs.append(http.start())
            http.wait_serving()
            yield HttpStack(target, draft, orchestrator, http, tokenizer)
        finally:
            for s in reversed(procs):
                s.stop()
