"""How faithful the emulated devices are: the tiny models' own CPU time per forward.

An emulated forward (:mod:`bench.emulated_device`) lasts the longer of its device
time and the tiny model's CPU time. Where the CPU time passes the device time the
emulation runs slower than the accelerator it stands for, and the figures there are
the CPU's, not the device's. :func:`forward_cpu_ms` measures that CPU time alone (no
device time added), on the benchmark's own prompts, for each batch width the benchmark
runs: a draft step (one token per session), a target verify of ``k + 1`` tokens per
session (a drafting round) and a target step of one token per session (plain
decoding). :func:`prefill_cpu_ms` times one prompt's prefill on each model: what a
session joining a running batch adds to a round (its target prefill, and under
speculation its draft's warm-up). :func:`cpu_bound` says which of them pass a setting's
device times.

With ``device`` cuda (``bench.emulated_gpu --device cuda``) the models are loaded there
and each forward is timed to a device synchronisation: the real forward's launches and
kernels, which an emulated forward on that device also lasts at least. The names keep
"cpu" (the JSON's keys); the sentences say what was timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

KV_BUDGET_BYTES = 1 << 30
TIMED_CALLS = 8  # timed calls per width and kind (after one untimed call)


def _timed_forwards(model: Any, device: str) -> list[float]:
    """Wrap ``model.forward`` so each call appends its seconds to the returned list (on
    CUDA from one device synchronisation to the next: the forward's kernels included)."""
    seconds: list[float] = []
    forward = model.forward
    cuda = device.startswith("cuda")

    def timed(*args: Any, **kwargs: Any) -> Any:
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        out = forward(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        return out

    model.forward = timed
    return seconds


def _median_ms(run: Callable[[], None], seconds: list[float]) -> float:
    """Median ms of the forwards ``run`` makes, over :data:`TIMED_CALLS` calls after one."""
    run()
    seconds.clear()
    for _ in range(TIMED_CALLS):
        run()
    return 1e3 * statistics.median(seconds)


def forward_cpu_ms(
    models: dict[str, Any],
    prompt_list: Sequence[Sequence[int]],
    sessions: Sequence[int],
    k: int,
    device: str = "cpu",
) -> dict[str, dict[int, float]]:
    """Median ms of one forward of each kind at each width in ``sessions``, every
    session holding one of ``prompt_list``, the models on ``device`` (run it in a child
    process: it loads both models). Kinds: ``draft_step``, ``target_verify`` (``k + 1``
    tokens a session), ``target_step``."""
    from specserve.serving.models import load_model

    if models["threads"]:
        torch.set_num_threads(models["threads"])
    target = load_model(models["target"], models["target_dtype"], device=device).model
    draft = load_model(models["draft"], models["draft_dtype"], device=device).model
    out: dict[str, dict[int, float]] = {"draft_step": {}, "target_verify": {}, "target_step": {}}
    for n in sessions:
        held = [list(prompt_list[i % len(prompt_list)]) for i in range(n)]
        for kind, ms in _width_cpu_ms(draft, target, held, k, device).items():
            out[kind][n] = ms
    return out


def _width_cpu_ms(
    draft: Any, target: Any, held: list[list[int]], k: int, device: str
) -> dict[str, float]:
    """:func:`forward_cpu_ms` for one batch: a session per history in ``held``."""
    from specserve.engine.drafter import DraftInput
    from specserve.engine.model_drafter import ModelDrafter
    from specserve.engine.rejection import Proposal
    from specserve.engine.sampling import SamplingParams
    from specserve.engine.verifier import TargetVerifier, VerifyInput

    greedy = SamplingParams()
    drafter = ModelDrafter(draft, KV_BUDGET_BYTES)
    verifier = TargetVerifier(target, KV_BUDGET_BYTES)
    ids = [f"s{i}" for i in range(len(held))]
    drafter.propose([DraftInput(s, 0, t, 1, greedy, 0) for s, t in zip(ids, held, strict=True)])
    verifier.verify(
        [VerifyInput(s, 0, t[:-1], Proposal([]), greedy, 0) for s, t in zip(ids, held, strict=True)]
    )
    # every call below feeds each session's last token again from the same position
    last = [(s, len(t) - 1, [t[-1]]) for s, t in zip(ids, held, strict=True)]

    def draft_round() -> None:
        drafter.propose([DraftInput(s, at, tok, k, greedy, 0) for s, at, tok in last])

    def target_round(drafts: int) -> None:
        verifier.verify(
            [VerifyInput(s, at, tok, Proposal([0] * drafts), greedy, 0) for s, at, tok in last]
        )

    draft_seconds = _timed_forwards(drafter.model, device)
    target_seconds = _timed_forwards(verifier.model, device)
    try:
        return {
            "draft_step": _median_ms(draft_round, draft_seconds),
            "target_verify": _median_ms(lambda: target_round(k), target_seconds),
            "target_step": _median_ms(lambda: target_round(0), target_seconds),
        }
    finally:
        del drafter.model.forward, verifier.model.forward  # back to the class's forward


PREFILL_PROMPTS = 8  # prompts whose prefill is timed, one at a time


def prefill_cpu_ms(
    models: dict[str, Any], prompt_list: Sequence[Sequence[int]], device: str = "cpu"
) -> dict[str, float]:
    """Median ms of one prompt's prefill forward on the draft (``draft_prefill``) and
    the target (``target_prefill``), both on ``device``, over the first
    :data:`PREFILL_PROMPTS` prompts, and their median length in tokens (``tokens``).
    Run it in a child process."""
    from specserve.engine.drafter import DraftInput
    from specserve.engine.model_drafter import ModelDrafter
    from specserve.engine.rejection import Proposal
    from specserve.engine.sampling import SamplingParams
    from specserve.engine.verifier import TargetVerifier, VerifyInput
    from specserve.serving.models import load_model

    if models["threads"]:
        torch.set_num_threads(models["threads"])
    greedy = SamplingParams()
    drafter = ModelDrafter(
        load_model(models["draft"], models["draft_dtype"], device=device).model, KV_BUDGET_BYTES
    )
    verifier = TargetVerifier(
        load_model(models["target"], models["target_dtype"], device=device).model,
        KV_BUDGET_BYTES,
    )
    draft_seconds = _timed_forwards(drafter.model, device)
    target_seconds = _timed_forwards(verifier.model, device)
    prompts = [list(p) for p in prompt_list[:PREFILL_PROMPTS]]
    draft_ms, target_ms = [], []
    for i, prompt in enumerate([prompts[0], *prompts]):  # the first once untimed
        draft_seconds.clear()
        target_seconds.clear()
        drafter.propose([DraftInput(f"p{i}", 0, prompt, 1, greedy, 0)])
        verifier.verify([VerifyInput(f"p{i}", 0, prompt, Proposal([]), greedy, 0)])
        if i:
            draft_ms.append(1e3 * draft_seconds[0])  # the prefill, not the one draft step
            target_ms.append(1e3 * target_seconds[0])
    return {
        "draft_prefill": statistics.median(draft_ms),
        "target_prefill": statistics.median(target_ms),
        "tokens": statistics.median(len(p) for p in prompts),
    }


def cpu_bound(
    cpu_ms: dict[str, dict[int, float]],
    draft_ms: float,
    target_ms: float,
    prefill_ms: dict[str, float] | None = None,
    device: str = "cpu",
) -> list[str]:
    """The (kind, width) whose own time (on ``device``) passes the device time of its
    model, and the prompt prefills (``prefill_ms``, :func:`prefill_cpu_ms`) that do, as
    sentences: where the emulation runs at the real forward's speed, not the device's."""
    own = "of CPU" if device == "cpu" else f"on {device}"
    emulated = {
        "draft_step": draft_ms,
        "target_verify": target_ms,
        "target_step": target_ms,
        "draft_prefill": draft_ms,
        "target_prefill": target_ms,
    }
    out = [
        f"{kind.replace('_', ' ')} at {n} sessions: {ms:.2f} ms {own} > {emulated[kind]:g} ms"
        for kind, widths in cpu_ms.items()
        for n, ms in widths.items()
        if ms > emulated[kind]
    ]
    for kind in ("draft_prefill", "target_prefill"):
        ms = (prefill_ms or {}).get(kind)
        if ms is not None and ms > emulated[kind]:
            out.append(
                f"{kind.replace('_', ' ')} of a prompt: {ms:.2f} ms {own} > {emulated[kind]:g} ms"
            )
    return out
