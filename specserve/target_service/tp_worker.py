"""The tensor-parallel rank group: rank 0 drives, the other ranks mirror its forwards.

Rank 0 holds a :class:`TPVerifier`, which has the interface of
:class:`~specserve.engine.verifier.TargetVerifier` (``verify``, ``release``,
``kv_stats``, ``sessions``) and is one inside: its KV bookkeeping, validation,
sampling and acceptance all run on rank 0 only. A forward pre-hook on rank 0's
model broadcasts one :class:`Step` per forward — the batch's session ids, new
tokens, ``num_logits``, and each session's cached length and block table — and
every other rank (:func:`run_worker`) runs the same forward on its shard and its
own KV pool, writing its KV heads to the same slots. Workers keep no bookkeeping
of their own: the block tables in each step are rank 0's, so truncation, release
and eviction on rank 0 need no message at all.

Failure: every collective has the group's timeout (:func:`~specserve.engine.tp.
init_tp`). While rank 0 is idle it sends an empty step every ``timeout / 3`` so
that waiting workers do not time out, and so that a dead worker is noticed even
without traffic. Once a collective fails the group is unusable: every later call
raises :class:`~specserve.engine.tp.TPGroupError` and :meth:`TPVerifier.healthy`
is False.

:func:`start_tp_verifier` is the one entry point for a server process, under
torchrun (``torchrun --nproc-per-node N -m specserve.target_service --tp N``) or
with ``launcher="ray"`` (:mod:`specserve.target_service.tp_ray`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from specserve.engine.errors import InvalidArgument
from specserve.engine.hugepages import move_to_huge_pages
from specserve.engine.kv_cache import KVPool, KVStats, slot_ids
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.tp import (
    TPContext,
    TPGroupError,
    apply_tp,
    init_tp,
    shutdown_tp,
)
from specserve.engine.verifier import TargetVerifier, Verifier, VerifyInput, VerifyOutcome
from specserve.target_service.tp_config import TPSettings

# Builds the whole model on the CPU; every rank calls it, then keeps its shard.
ModelFactory = Callable[[], CausalLM]


@dataclass(frozen=True)
class Step:
    """What every rank does next: one forward, nothing (a heartbeat), or stop."""

    seqs: tuple[SeqInput, ...] = ()
    starts: tuple[int, ...] = ()  # tokens cached for each session before the forward
    tables: tuple[tuple[int, ...], ...] = ()  # rank 0's blocks covering start + new tokens
    stop: bool = False


class TPVerifier:
    """Rank 0's verifier; every forward it runs is mirrored on the other ranks."""

    def __init__(
        self,
        model: CausalLM,
        kv_budget_bytes: int,
        ctx: TPContext,
        *,
        vocab_limit: int | None = None,
        heartbeat_s: float | None = None,
    ) -> None:
        assert ctx.rank == 0, "only rank 0 drives the group"
        self.ctx = ctx
        self.model = model
        self._local = TargetVerifier(model, kv_budget_bytes, vocab_limit=vocab_limit)
        self.vocab_limit = self._local.vocab_limit
        self._lock = threading.RLock()
        self._armed = False  # a forward outside verify() would desynchronise the ranks
        self._in_forward = False  # a step went out and rank 0's forward has not finished
        self._failure: BaseException | None = None
        self._closed = threading.Event()
        self._last_send = time.monotonic()
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward),
        ]
        interval = heartbeat_s if heartbeat_s is not None else ctx.timeout_s / 3
        self._heartbeat = threading.Thread(
            target=self._beat, args=(interval,), name="tp-heartbeat", daemon=True
        )
        self._heartbeat.start()

    # -- the TargetVerifier interface -------------------------------------------

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def kv(self) -> KVPool:
        """Rank 0's pool: the bookkeeping of record (read it, do not change it)."""
        return self._local.kv

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyOutcome]:
        """As :meth:`TargetVerifier.verify`; raises :class:`TPGroupError` if a rank failed."""
        with self._lock:
            self._check()
            self._armed = True
            try:
                return self._local.verify(inputs)
            except Exception as e:
                if not self._in_forward:
                    raise  # before the step went out or after every rank finished it
                # An all-reduce failed, or rank 0 failed between its collectives: the
                # ranks are out of step for good.
                self._failure = e
                raise TPGroupError(f"tensor-parallel forward failed: {e}") from e
            finally:
                self._armed = self._in_forward = False

    def release(self, session_id: str) -> bool:
        with self._lock:  # rank 0's bookkeeping only: workers read block tables per step
            return self._local.release(session_id)

    def release_sessions(self, session_ids: Sequence[str]) -> frozenset[str]:
        with self._lock:
            return self._local.release_sessions(session_ids)

    def holding(self, session_ids: Sequence[str]) -> frozenset[str]:
        with self._lock:
            return self._local.holding(session_ids)

    def kv_stats(self) -> KVStats:
        with self._lock:
            return self._local.kv_stats()

    def sessions(self) -> int:
        with self._lock:
            return self._local.sessions()

    # -- group life --------------------------------------------------------------

    def healthy(self) -> bool:
        """False once a rank failed or the group was closed (health: NOT_SERVING)."""
        return self._failure is None and not self._closed.is_set()

    def close(self) -> None:
        """Stop the workers (they leave their loop and the group), the heartbeat, and leave."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            for hook in self._hooks:
                hook.remove()
            if self._failure is None:
                with contextlib.suppress(TPGroupError):  # a dead rank has nothing to stop
                    self._send(Step(stop=True))
        self._heartbeat.join(timeout=self.ctx.timeout_s)
        if self._failure is None:
            shutdown_tp()  # after a failure the group may not tear down cleanly: leave it

    # -- internals ---------------------------------------------------------------

    def _check(self) -> None:
        if self._closed.is_set():
            raise TPGroupError("the tensor-parallel group was closed")
        if self._failure is not None:
            raise TPGroupError(
                f"the tensor-parallel group failed earlier and is unusable: {self._failure}"
            ) from self._failure

    def _before_forward(
        self, _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        assert self._armed, "the TP target model may only run inside TPVerifier.verify"
        seqs, kv = (*args, *kwargs.values())[:2]
        kv = cast(KVPool, kv)
        blocks = kv.alloc.blocks_needed
        starts = tuple(kv.length(s.session_id) for s in seqs)
        tables = tuple(
            tuple(kv.alloc.block_table(s.session_id)[: blocks(a + len(s.token_ids))])
            for s, a in zip(seqs, starts, strict=True)
        )
        self._send(Step(seqs=tuple(seqs), starts=starts, tables=tables))
        self._in_forward = True

    def _after_forward(self, _module: torch.nn.Module, _args: Any, _output: Any) -> None:
        self._in_forward = False

    def _send(self, step: Step) -> None:
        try:
            dist.broadcast_object_list([step], src=0, group=self.ctx.control)
        except Exception as e:  # gloo: closed socket or timeout
            self._failure = e
            raise TPGroupError(f"a tensor-parallel rank stopped answering: {e}") from e
        self._last_send = time.monotonic()

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval / 2):
            with self._lock:
                if self._closed.is_set() or self._failure is not None:
                    return
                if time.monotonic() - self._last_send >= interval:
                    try:
                        self._send(Step())
                    except TPGroupError:
                        return


class _StepPool:
    """A worker's KV pool seen through one step's block tables (as model.forward needs)."""

    def __init__(self, pool: KVPool, step: Step) -> None:
        self.k, self.v, self.device = pool.k, pool.v, pool.device
        self._block_size = pool.block_size
        top = max((max(t, default=0) for t in step.tables), default=0)
        assert top < pool.alloc.num_blocks, "rank 0's KV pool is larger than this rank's"
        ids = [s.session_id for s in step.seqs]
        self._lengths = dict(zip(ids, step.starts, strict=True))
        self._tables = dict(zip(ids, step.tables, strict=True))

    def length(self, session_id: str) -> int:
        return self._lengths[session_id]

    def host_slots(self, session_id: str, start: int, end: int) -> torch.Tensor:
        return slot_ids(self._tables[session_id], self._block_size, start, end)  # [end - start]

    def advance(self, session_id: str, n: int, token_ids: Sequence[int] | None = None) -> None:
        self._lengths[session_id] += n  # a chunk of a chunked prefill, or the whole step


def run_worker(model: CausalLM, kv_budget_bytes: int, ctx: TPContext) -> None:
    """Mirror rank 0's forwards until it sends stop; raises if rank 0 goes away."""
    assert ctx.rank != 0, "rank 0 drives the group with a TPVerifier"
    pool = model.new_kv_pool(kv_budget_bytes)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ctx.control)
        step = cast(Step, box[0])
        if step.stop:
            return
        if step.seqs:
            model(step.seqs, cast(KVPool, _StepPool(pool, step)))


def shard_model(load: ModelFactory, ctx: TPContext) -> CausalLM:
    """Build the model, keep this rank's shard and move it to the rank's device."""
    model = apply_tp(load(), ctx.rank, ctx.world_size, ctx.group)
    if torch.device(ctx.device).type == "cpu":
        move_to_huge_pages(model)  # the shard alone: the full weights loaded off huge pages
    return model.to(ctx.device)


def start_tp_verifier(
    load: ModelFactory,
    kv_budget_bytes: int,
    settings: TPSettings,
    *,
    vocab_limit: int | None = None,
) -> Verifier | None:
    """The verifier a target server serves with, or None on a torchrun worker rank.

    ``world_size == 1``: a plain :class:`TargetVerifier`. ``launcher="torchrun"``:
    every process calls this; rank 0 gets a :class:`TPVerifier`, the others serve
    as workers until rank 0 closes it, leave the group and get None (their process
    should then exit). ``launcher="ray"``: this process starts one Ray actor per
    rank and gets a :class:`~specserve.target_service.tp_ray.RayTPVerifier`; ``load``
    must then be picklable (it runs in the actors).
    """
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    if settings.world_size == 1:
        return TargetVerifier(load(), kv_budget_bytes, vocab_limit=vocab_limit)
    if settings.launcher == "ray":
        from specserve.target_service.tp_ray import start_ray  # Ray is an optional extra

        return start_ray(load, kv_budget_bytes, settings, vocab_limit=vocab_limit)
    # torchrun's contract is the environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*.
    started = int(os.environ.get("WORLD_SIZE", "1"))
    if started != settings.world_size:
        raise InvalidArgument(
            f"--tp {settings.world_size} needs {settings.world_size} processes but "
            f"{started} were started; run torchrun --nproc-per-node {settings.world_size}"
        )
    ctx = init_tp(
        settings.backend, settings.timeout_s, local_rank=int(os.environ.get("LOCAL_RANK", "0"))
    )
    return start_rank(load, kv_budget_bytes, ctx, vocab_limit=vocab_limit)


def start_rank(
    load: ModelFactory, kv_budget_bytes: int, ctx: TPContext, *, vocab_limit: int | None = None
) -> TPVerifier | None:
    """After :func:`init_tp`: rank 0 gets its verifier; other ranks serve, then return None."""
    model = shard_model(load, ctx)
    if ctx.rank == 0:
        return TPVerifier(model, kv_budget_bytes, ctx, vocab_limit=vocab_limit)
    try:
        run_worker(model, kv_budget_bytes, ctx)
    finally:
        shutdown_tp()
    return None
