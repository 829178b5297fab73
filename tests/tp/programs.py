"""What each rank runs in the TP tests (module level, so spawned processes can import it)."""

from __future__ import annotations

import copy
import os
import pickle
import random
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.errors import InvalidArgument
from specserve.engine.kv_cache import KVPool
from specserve.engine.model import CausalLM, SeqInput
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.rejection import Proposal
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.tp import TPGroupError, apply_tp, init_tp, shutdown_tp
from specserve.engine.verifier import VerifyInput
from specserve.policy.k_policy import KPolicy
from specserve.target_service.tp_config import TPSettings
from specserve.target_service.tp_worker import start_tp_verifier
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 8 << 20
GREEDY = SamplingParams()
GREEDY_CASE = {"seed": 1, "model_type": "qwen2", "k": 4}


def load_target(seed: int, model_type: str) -> CausalLM:
    return tiny_model(seed, model_type)


# -- logits --------------------------------------------------------------------------


def _batches() -> list[list[SeqInput]]:
    """Ragged prefills, a ragged multi-token step (a verify), then one token each."""
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    return [
        [SeqInput("a", toks(7), 7), SeqInput("b", toks(3), 3), SeqInput("c", toks(12), 1)],
        [SeqInput("a", toks(4), 4), SeqInput("b", toks(1), 1), SeqInput("c", toks(6), 6)],
        [SeqInput(s, toks(1), 1) for s in "abc"],
    ]


def _forward_all(model: CausalLM) -> tuple[list[torch.Tensor], KVPool]:
    pool = model.new_kv_pool(1 << 20)
    out = []
    for seqs in _batches():
        pool.reserve({s.session_id: len(s.token_ids) for s in seqs})
        out.append(model(seqs, pool))
    return out, pool


def logits_program(
    rank: int, world: int, out: Path, model_type: str, backend: str = "gloo"
) -> None:
    """Every rank runs the same batches on its shard; rank 0 also runs the whole model."""
    ctx = init_tp(backend, 20.0, local_rank=rank)
    model = load_target(3, model_type)
    whole = copy.deepcopy(model).to(ctx.device) if rank == 0 else None
    apply_tp(model, ctx.rank, ctx.world_size, ctx.group).to(ctx.device)
    sharded, pool = _forward_all(model)
    if whole is not None:
        reference, whole_pool = _forward_all(whole)
        torch.save(
            {
                "tp": [t.cpu() for t in sharded],
                "ref": [t.cpu() for t in reference],
                "kv_heads": (pool.k[0].shape[1], whole_pool.k[0].shape[1]),
                "q_rows": model.model.layers[0].self_attn.q_proj.weight.shape[0],
            },
            out / "logits.pt",
        )
    shutdown_tp()


def families_logits_program(rank: int, world: int, out: Path, paths: list[str]) -> None:
    """:func:`logits_program` for each checkpoint in ``paths`` (the family tests' models,
    loaded as files are), in one group."""
    from specserve.engine.loader import load_model

    ctx = init_tp("gloo", 20.0, local_rank=rank)
    saved = {}
    for path in paths:
        model, _ = load_model(path, huge_pages=False)
        whole = copy.deepcopy(model) if rank == 0 else None
        apply_tp(model, ctx.rank, ctx.world_size, ctx.group)
        sharded, pool = _forward_all(model)
        if whole is not None:
            saved[path] = {
                "tp": sharded,
                "ref": _forward_all(whole)[0],
                "kv_heads": (pool.k[0].shape[1], whole.new_kv_pool(1 << 20).k[0].shape[1]),
            }
    if rank == 0:
        torch.save(saved, out / "families.pt")
    shutdown_tp()


# -- greedy decoding through the verifier ---------------------------------------------


def prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    base = [[rng.randrange(256) for _ in range(5 + 3 * i)] for i in range(count)]
    return [b * 3 for b in base]


def decode(verifier: Any, seed: int, model_type: str, k: int, n: int = 24) -> dict[str, Any]:
    """Target-only and speculative greedy decoding of the same prompts through ``verifier``."""
    draft = noisy_copy(load_target(seed, model_type), noise=0.3, seed=seed + 100)
    engine = SpeculativeEngine(verifier, {"model": ModelDrafter(draft, BUDGET)})
    result: dict[str, Any] = {}
    for name, drafter, kk in (("plain", "none", 0), ("spec", "model", k)):
        states = [
            DecodeState(f"{name}{i}", p, GREEDY, StopCriteria(n), KPolicy(kk), drafter=drafter)
            for i, p in enumerate(prompts(seed))
        ]
        engine.run(states)
        result[name] = [s.completion for s in states]
        result[f"{name}_drafted"] = sum(s.stats.drafted for s in states)
        result[f"{name}_accepted"] = sum(s.stats.accepted for s in states)
    result["max_batch"] = max(engine.timing.batch_sizes)
    result["blocks_used"] = verifier.kv_stats().blocks_used
    return result


def greedy_program(
    rank: int, world: int, out: Path, seed: int, model_type: str, k: int, timeout_s: float
) -> None:
    """Launched as under torchrun: rank 0 decodes through its TPVerifier, rank 1 serves."""
    settings = TPSettings(world_size=world, backend="gloo", timeout_s=timeout_s, num_threads=1)
    verifier = start_tp_verifier(partial(load_target, seed, model_type), BUDGET, settings)
    if verifier is None:
        return  # a worker: rank 0 closed the group
    try:  # bad input is refused on rank 0 before any step goes out; the group stays usable
        verify_once(verifier, "bad", tokens=[5, 1 << 20])
    except InvalidArgument as e:
        bad_input = str(e)
    result = decode(verifier, seed, model_type, k)
    result["bad_input"] = bad_input
    verifier.close()  # type: ignore[attr-defined]
    (out / "greedy.pkl").write_bytes(pickle.dumps(result))


def chunked_program(rank: int, world: int, out: Path, timeout_s: float) -> None:
    """Rank 0 prefills one prompt in one verify and another copy of it over several (the
    orchestrator's chunked prefill), then decodes both greedily; rank 1 serves."""
    from tests.engine.test_chunked_prefill import greedy_after_prefill, prompt

    settings = TPSettings(world_size=world, backend="gloo", timeout_s=timeout_s, num_threads=1)
    verifier = start_tp_verifier(partial(load_target, 3, "qwen2"), 16 << 20, settings)
    if verifier is None:
        return
    tokens = prompt(1200, 11)
    result = {
        name: greedy_after_prefill(verifier, name, tokens, chunks, 12)
        for name, chunks in (("whole", []), ("chunked", [700, 1, 37, 300]))
    }
    verifier.close()  # type: ignore[attr-defined]
    (out / "chunked.pkl").write_bytes(pickle.dumps(result))


# -- failure --------------------------------------------------------------------------


def verify_once(verifier: Any, session: str, tokens: list[int] | None = None) -> None:
    verifier.verify(
        [
            VerifyInput(
                session_id=session,
                start=0,
                new_tokens=tokens or [5, 6, 7, 8],
                proposal=Proposal(tokens=[9, 10]),
                params=GREEDY,
                round_index=0,
            )
        ]
    )


def kill_program(
    rank: int, world: int, out: Path, timeout_s: float, idle_s: float, how: str
) -> None:
    """Rank 0 verifies, idles (heartbeats keep rank 1 waiting), verifies again, then
    kills (``how="kill"``) or freezes (``"stop"``) rank 1 and times the next verify."""
    (out / f"pid{rank}").write_text(str(os.getpid()))
    settings = TPSettings(world_size=world, backend="gloo", timeout_s=timeout_s, num_threads=1)
    verifier: Any = start_tp_verifier(partial(load_target, 1, "qwen2"), BUDGET, settings)
    if verifier is None:
        return
    result: dict[str, Any] = {}
    verify_once(verifier, "first")
    time.sleep(idle_s)
    verify_once(verifier, "after-idle")
    result["healthy_before"] = verifier.healthy()
    worker = int((out / "pid1").read_text())
    os.kill(worker, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    time.sleep(0.2)  # let the kernel close a dead rank's sockets
    started = time.monotonic()
    try:
        verify_once(verifier, "after-kill")
        result["error"] = None
    except TPGroupError as e:
        result["error"] = str(e)
    result["elapsed"] = time.monotonic() - started
    result["healthy_after"] = verifier.healthy()
    started = time.monotonic()
    try:
        verify_once(verifier, "again")
    except TPGroupError as e:
        result["second_error"] = str(e)
    result["second_elapsed"] = time.monotonic() - started
    (out / "kill.pkl").write_bytes(pickle.dumps(result))
    if how == "stop":
        os.kill(worker, signal.SIGKILL)
    os._exit(0)  # the group is broken: skip interpreter teardown of its process group
