"""Verify batches through static-shape steps: buckets, their buffers, CUDA graphs.

A :class:`StepRunner` serves a :class:`~specserve.engine.verifier.TargetVerifier`'s
decode and verify steps through a :class:`~specserve.engine.static_step.StaticStep`
where the step applies (:meth:`StepRunner.takes`): every session greedy or coupled,
no logprobs, one step, at most ``k_max + 1`` new tokens after its committed ones and a
context that fits the slot tables; other batches run on the eager forward. Per round
the host fills one int64 and one float64 tensor (on a GPU: copied in two transfers
into the bucket's fixed buffers), runs the step (a CUDA graph's replay, a compiled
function or the eager step) and reads back one ``[sessions, 3]`` tensor: accepted
drafts, next token, new length.

Options (:class:`StepOptions`):

* ``capture`` (CUDA): every bucket is captured as a CUDA graph when the runner is
  built (a server's start), the capture time logged; off, the step runs eagerly
  (or compiled), launching its kernels from the host each round.
* ``compile``: a ``torch.compile`` backend for the step (``"inductor"``,
  ``"aot_eager"``), ``fullgraph=True``, one graph per bucket; None runs it as written.
* ``batch_invariant``: every step runs in the ``k_max + 1``-token bucket, so a one-token
  decode and a (k + 1)-token verify run the same kernels at the same shapes and each
  row gets the same bits either way (what should make greedy bfloat16 speculation equal to
  target-only decoding on a GPU, where a GEMM's rounding depends on its row count).

A session's committed tokens but the last (a prompt, a catch-up) run on the eager
forward first, in one forward for the batch; the step takes the last one and the
drafts (:class:`StepRow`). A draft model's steps (``support`` > 0, ``k_max`` 0) are the
same step with no drafts: its next token is the draft
(:class:`~specserve.engine.model_drafter.ModelDrafter`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine import coupling
from specserve.engine.kv_cache import KVPool
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.rejection import Verdict
from specserve.engine.sampling import SamplingParams
from specserve.engine.static_step import (
    COUPLED,
    N_DRAFT,
    N_NEW,
    SESSION_BUCKETS,
    START,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Bucket,
    StaticStep,
)

if TYPE_CHECKING:
    from specserve.engine.verifier import VerifyInput

log = logging.getLogger(__name__)

Step = Callable[[Bucket, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepOptions:
    """How a target runs its static steps (see the module doc)."""

    k_max: int = 8  # drafts per session a step takes
    context: int = 4096  # positions a step addresses (its slot tables' width)
    sessions: tuple[int, ...] = SESSION_BUCKETS  # session buckets built (and captured)
    capture: bool = True  # CUDA graphs per bucket (CUDA only)
    compile: str | None = None  # torch.compile backend, None: the step as written
    batch_invariant: bool = False  # every step in the k_max + 1 bucket
    sampled: bool = True  # build (capture) sampled buckets too; off: greedy batches only
    # > 0: a draft model's steps (k_max 0): a coupled row picks among its support
    # likeliest ids, as draft_sampling draws (Bucket.support)
    support: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 0 or self.context < 1 or not self.sessions:
            raise ValueError(f"bad step options {self}")
        if any(s not in SESSION_BUCKETS for s in self.sessions):
            raise ValueError(f"session buckets must be among {SESSION_BUCKETS}")

    @property
    def token_buckets(self) -> tuple[int, ...]:
        return (self.k_max + 1,) if self.batch_invariant else tuple(range(1, self.k_max + 2))


@dataclass(frozen=True)
class StepRow:
    """One session's part of a step: its new tokens (committed ones, then ``drafts``
    draft tokens) after the ``start`` it holds, its sampling parameters, and the absolute
    position of the first token the step draws (the one after the committed tokens)."""

    session_id: str
    start: int
    tokens: Sequence[int]  # at least one committed token, then the drafts
    drafts: int
    params: SamplingParams
    position: int

    @property
    def head(self) -> Sequence[int]:
        """The committed tokens but the last: run on the eager forward first."""
        return self.tokens[: len(self.tokens) - self.drafts - 1]

    @property
    def tail(self) -> Sequence[int]:
        """The last committed token and the drafts: what the step runs."""
        return self.tokens[len(self.tokens) - self.drafts - 1 :]


@dataclass
class _Graph:
    ints: torch.Tensor
    floats: torch.Tensor
    out: torch.Tensor
    graph: torch.cuda.CUDAGraph


class StepRunner:
    """Static steps for one target model and its KV pool."""

    def __init__(
        self, model: CausalLM, kv: KVPool, options: StepOptions, *, vocab_limit: int
    ) -> None:
        self.model, self.kv, self.options = model, kv, options
        context = min(options.context, model.config.max_position_embeddings)
        self.step = StaticStep(model, kv, context, vocab_limit)
        self.context = context
        self._run: Step = self.step
        if options.compile is not None:
            _raise_recompile_limit(4 * len(options.sessions) * len(options.token_buckets))
            self._run = torch.compile(self.step._step, backend=options.compile, fullgraph=True)
        self.graphs: dict[Bucket, _Graph] = {}
        # Per bucket: host inputs reused round after round (pinned on CUDA); the read back
        # of each step's output ends it before the next fills them.
        self._host: dict[Bucket, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds: float | None = None
        self.runs = 0  # steps run (for tests and metrics)
        if options.capture and model.device.type == "cuda":
            self.capture_all()

    @staticmethod
    def unsupported(model: CausalLM) -> str | None:
        """Why ``model`` cannot take static steps, or None when it can."""
        return StaticStep.supports(model)

    @classmethod
    def build_or_none(
        cls, model: CausalLM, kv: KVPool, options: StepOptions, vocab_limit: int, what: str
    ) -> StepRunner | None:
        """The runner, or None (logged, ``what`` naming the steps) where ``model`` cannot
        take static steps or building them failed: a server then runs its steps on the
        eager forward rather than not at all."""
        why = cls.unsupported(model)
        if why is not None:
            log.info("static %s off: %s", what, why)
            return None
        try:
            return cls(model, kv, options, vocab_limit=vocab_limit)
        except Exception:
            log.exception("static %s failed to build; they run on the eager forward", what)
            return None

    # -- which batches ---------------------------------------------------------------

    def takes(self, inputs: Sequence[VerifyInput]) -> bool:
        """Whether a static step can serve this verify batch (else the eager forward)."""
        if not 0 < len(inputs) <= max(self.options.sessions):
            return False
        for x in inputs:
            k = len(x.proposal.tokens)
            if (
                x.steps != 1
                or x.want_logprobs
                or x.top_logprobs is not None
                or not (x.params.greedy or (x.params.coupled and self.options.sampled))
                or k > self.options.k_max
                or x.start + len(x.new_tokens) + k > self.context
            ):
                return False
        return True

    def takes_rows(self, rows: Sequence[StepRow]) -> bool:
        """Whether a static step can serve these rows (greedy or coupled, within the
        buckets and the context)."""
        if not 0 < len(rows) <= max(self.options.sessions):
            return False
        return all(
            (r.params.greedy or (r.params.coupled and self.options.sampled))
            and r.drafts <= self.options.k_max
            and r.start + len(r.tokens) <= self.context
            for r in rows
        )

    # -- one batch -------------------------------------------------------------------

    def verify(self, inputs: Sequence[VerifyInput]) -> list[Verdict]:
        """Run the batch's step (space reserved, caches synced to each ``start``) and
        advance each cache by the tokens written; the caller truncates to the verdicts."""
        rows = [
            StepRow(
                x.session_id,
                x.start,
                [*x.new_tokens, *x.proposal.tokens],
                len(x.proposal.tokens),
                x.params,
                x.committed_len,
            )
            for x in inputs
        ]
        out = self.run_rows(rows)
        return [Verdict(accepted=a, next_token=t) for a, t in out]

    def run_rows(self, rows: Sequence[StepRow]) -> list[tuple[int, int]]:
        """(accepted, next token) of each row's step; every row's tokens are written to
        its cache (space reserved) and its length advanced past them. A row's tokens
        before its last committed one (a prompt, a catch-up) run first on the eager
        forward, in one forward for the batch."""
        heads = [SeqInput(r.session_id, r.head, 0) for r in rows if r.head]
        if heads:
            self.model(heads, self.kv)
        tokens = self.options.k_max + 1 if self.options.batch_invariant else 0
        tokens = max(tokens, *(len(r.tail) for r in rows))
        sampled = any(not r.params.greedy for r in rows)
        sessions = min(s for s in self.options.sessions if s >= len(rows))
        bucket = Bucket(sessions, tokens, sampled, self.options.support)
        ints, floats = self._host_inputs(bucket, rows)
        out = self.run(bucket, ints, floats).tolist()  # the one read back
        for r in rows:
            self.kv.advance(r.session_id, len(r.tail), r.tail)
        return [(int(o[0]), int(o[1])) for o in out[: len(rows)]]

    def run(self, bucket: Bucket, ints: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
        """The step's ``[sessions, 3]`` output for host (or device) inputs ``ints`` and
        ``floats``: a captured graph's replay where there is one, else the step."""
        self.runs += 1
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.ints.copy_(ints, non_blocking=True)
            graph.floats.copy_(floats, non_blocking=True)
            graph.graph.replay()
            return graph.out
        device = self.model.device
        with torch.inference_mode():
            return self._run(bucket, ints.to(device), floats.to(device))

    def _host_inputs(
        self, bucket: Bucket, rows: Sequence[StepRow]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's ``ints`` and ``floats`` for ``rows`` on the host (pinned on CUDA)."""
        lay = self.step.layout(bucket)
        host = self._host.get(bucket)
        if host is None:
            cpu = torch.device("cpu")
            pin = self.model.device.type == "cuda"
            host = self._host[bucket] = self.step.inputs(bucket, cpu, pin=pin)
        else:
            self.step.clear(bucket, *host)
        ints, floats = host
        # Filled through numpy views of the same memory: ~1 us an assignment, not ~10.
        a, f = ints.numpy(), floats.numpy()
        offsets = np.arange(bucket.tokens)
        for b, r in enumerate(rows):
            tail = r.tail
            a[b, START] = r.start + len(r.head)  # cached before the step's tokens
            a[b, N_NEW], a[b, N_DRAFT] = len(tail), r.drafts
            a[b, TOP_K], a[b, COUPLED] = r.params.top_k, int(r.params.coupled)
            a[b, lay.token_ids][: len(tail)] = tail
            a[b, lay.drafts][: r.drafts] = tail[1:]
            if r.params.coupled:
                seed = np.full(bucket.tokens, r.params.seed & ((1 << 64) - 1), dtype=np.uint64)
                a[b, lay.keys] = coupling.keys(seed, r.position + offsets).view(np.int64)
            blocks = len(self.kv.alloc.block_table(r.session_id))
            reserved = min(blocks * self.kv.block_size, self.context)
            a[b, lay.table][:reserved] = self.kv.host_slots(r.session_id, 0, reserved).numpy()
            f[b, TEMPERATURE] = max(r.params.temperature, 1e-30)
            f[b, TOP_P] = r.params.top_p
        return ints, floats

    # -- CUDA graphs -----------------------------------------------------------------

    def buckets(self) -> list[Bucket]:
        """Every bucket the options name, largest first (what capture builds)."""
        return [
            Bucket(s, t, sampled, self.options.support)
            for s in sorted(self.options.sessions, reverse=True)
            for t in sorted(self.options.token_buckets, reverse=True)
            for sampled in ((True, False) if self.options.sampled else (False,))
        ]

    def capture_all(self) -> float:
        """Capture every bucket's step as a CUDA graph (sharing one memory pool); returns
        and logs the seconds it took."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in self.buckets():
            self.graphs[bucket] = self._capture(bucket, pool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        log.info(
            "captured %d CUDA graphs (sessions %s x tokens %s x greedy/sampled) in %.1f s",
            len(self.graphs),
            ",".join(map(str, self.options.sessions)),
            ",".join(map(str, self.options.token_buckets)),
            self.capture_seconds,
        )
        return self.capture_seconds

    def _capture(self, bucket: Bucket, pool: tuple[int, int]) -> _Graph:
        ints, floats = self.step.inputs(bucket)  # padding sessions: writes the scratch slot only
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: cuBLAS handles, autotuning, a compile
                self._run(bucket, ints, floats)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            out = self._run(bucket, ints, floats)
        return _Graph(ints, floats, out, graph)


def _raise_recompile_limit(graphs: int) -> None:
    """Let dynamo keep one compiled graph per bucket (its default keeps 8 per function)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < graphs:
            setattr(config, name, graphs)
