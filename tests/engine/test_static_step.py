"""The static-shape step (specserve.engine.static_step) and its runner.

On a CPU: the step compiles with ``torch.compile(fullgraph=True)`` without a graph break,
with the engine's kernels inside (custom ops with fakes) and without them (the torch
path CUDA runs); its tokens equal the eager engine's target-only tokens, greedy and
coupled, with drafts accepted, eager and compiled alike. The ``gpu`` tests check CUDA
graphs and batch-invariant verify on a device.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from specserve.engine import cpu_kernels, ops
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.model import CausalLM
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams, batched_probabilities
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.static_sampling import probabilities
from specserve.engine.static_step import Bucket, StaticStep
from specserve.engine.step_runner import StepOptions, StepRunner
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 4 << 20
NEW = 16
GREEDY = SamplingParams()
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def pair() -> tuple[CausalLM, CausalLM]:
    target = tiny_model(11)
    return target, noisy_copy(target, noise=0.3, seed=111)


def coupled(i: int) -> SamplingParams:
    return SamplingParams(0.8, top_k=40, top_p=0.95, seed=77 + i)


def decode(
    target: CausalLM,
    draft: CausalLM,
    params: list[SamplingParams],
    k: int,
    steps: StepOptions | None,
    draft_steps: StepOptions | None = None,
) -> tuple[list[DecodeState], TargetVerifier, ModelDrafter]:
    verifier = TargetVerifier(target, BUDGET, steps=steps)
    drafter = ModelDrafter(draft, BUDGET, steps=draft_steps)
    engine = SpeculativeEngine(verifier, {"model": drafter})
    rng = random.Random(5)
    states = [
        DecodeState(
            f"s{i}",
            [rng.randrange(256) for _ in range(5 + 3 * i)],
            p,
            StopCriteria(NEW),
            KPolicy(k),
            drafter="model" if k else "none",
        )
        for i, p in enumerate(params)
    ]
    engine.run(states)
    return states, verifier, drafter


def check_equal_to_target_only(
    pair: tuple[CausalLM, CausalLM], params: list[SamplingParams], steps: StepOptions
) -> TargetVerifier:
    plain, _, _ = decode(*pair, params, 0, None)  # the eager engine, target only
    spec, verifier, _ = decode(*pair, params, 4, steps)
    assert [s.completion for s in spec] == [p.completion for p in plain]
    assert sum(s.stats.drafted for s in spec) > 0 and sum(s.stats.accepted for s in spec) > 0
    assert verifier.steps is not None and verifier.steps.runs > 0  # the static step ran
    return verifier


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels off (what CUDA runs), and any call that still reaches them fails."""

    def forbidden() -> None:
        raise AssertionError("the torch path called the CPU kernels")

    monkeypatch.setattr(cpu_kernels, "kernels", forbidden)
    with ops.kernels_enabled(False):
        yield


# -- compile --------------------------------------------------------------------------


def step_and_inputs(model: CausalLM, bucket: Bucket) -> tuple[StaticStep, tuple]:
    kv = model.new_kv_pool(BUDGET)
    step = StaticStep(model, kv, context=64, vocab_limit=model.config.vocab_size)
    ints, floats = step.inputs(bucket)
    lay = step.layout(bucket)
    ints[0, 1], ints[0, 2] = bucket.tokens, bucket.tokens - 1  # n_new, n_draft
    ints[0, lay.token_ids] = torch.arange(3, 3 + bucket.tokens)
    return step, (bucket, ints, floats)


def explain(model: CausalLM, bucket: Bucket) -> object:
    step, args = step_and_inputs(model, bucket)
    with torch.inference_mode():
        return torch._dynamo.explain(step._step)(*args)


def test_the_step_is_one_graph_with_the_kernels(pair: tuple) -> None:
    """A sampled bucket (it holds every op a greedy one does, and the coupled argmax)."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    out = explain(pair[0], Bucket(2, 3, True))
    assert out.graph_break_count == 0 and out.graph_count == 1, out.break_reasons
    called = {str(n.target) for g in out.graphs for n in g.graph.nodes}
    for op in ("linears", "rope_cache_attention", "rms_norm", "gate_up_silu", "coupled_argmax"):
        assert any(f".{op}." in c for c in called), (op, called)


def test_the_step_is_one_graph_on_the_torch_path(pair: tuple, torch_path: None) -> None:
    out = explain(pair[0], Bucket(2, 3, True))
    assert out.graph_break_count == 0 and out.graph_count == 1, out.break_reasons


# -- tokens ---------------------------------------------------------------------------


def test_greedy_static_steps_give_target_only_tokens(pair: tuple) -> None:
    check_equal_to_target_only(pair, [GREEDY] * 3, StepOptions(k_max=4, context=128))


def test_coupled_static_steps_give_target_only_tokens(pair: tuple) -> None:
    params = [coupled(i) for i in range(3)]
    check_equal_to_target_only(pair, params, StepOptions(k_max=4, context=128))


def test_the_torch_path_gives_target_only_tokens(pair: tuple, torch_path: None) -> None:
    params = [GREEDY, coupled(1), coupled(2)]
    check_equal_to_target_only(pair, params, StepOptions(k_max=4, context=128))


def test_a_compiled_step_gives_the_eager_steps_tokens(pair: tuple) -> None:
    """fullgraph=True (aot_eager: the graph as traced, run by eager kernels): greedy and
    coupled sessions in one batch, one (sampled) bucket compiled, target-only tokens."""
    params = [GREEDY, coupled(1), coupled(2)]
    steps = StepOptions(k_max=4, context=128, sessions=(4,), batch_invariant=True)
    compiled = replace(steps, compile="aot_eager")
    eager = check_equal_to_target_only(pair, params, steps)
    check_equal_to_target_only(pair, params, compiled)
    assert eager.steps is not None and eager.steps.runs > 0


def test_static_draft_steps_propose_the_eager_drafts(pair: tuple) -> None:
    """A draft's static steps (no drafts; coupled rows choose among max_support ids as
    draft_sampling does) propose what its eager steps propose: the same accepted counts,
    the target-only tokens."""
    params = [GREEDY, coupled(1), coupled(2)]
    eager, _, _ = decode(*pair, params, 4, None)
    steps = StepOptions(context=128)
    static, _, drafter = decode(*pair, params, 4, None, draft_steps=steps)
    plain, _, _ = decode(*pair, params, 0, None)
    assert [s.completion for s in static] == [p.completion for p in plain]
    assert [s.stats.accepted for s in static] == [s.stats.accepted for s in eager]
    assert sum(s.stats.accepted for s in static) > 0
    assert drafter.steps is not None and drafter.steps.runs > 0


@pytest.mark.slow  # inductor compiles C++ for about a minute on two cores
def test_an_inductor_compiled_step_gives_the_eager_steps_output(pair: tuple) -> None:
    """(The inputs' slot tables are all scratch: every run writes and reads the same slot,
    so the two runs see the same cache.)"""
    step, args = step_and_inputs(pair[0], Bucket(2, 3, False))
    compiled = torch.compile(step._step, backend="inductor", fullgraph=True)
    with torch.inference_mode():
        got = compiled(*args)
        want = step._step(*args)
    assert torch.equal(got, want)


def test_a_model_with_hooks_stays_on_the_eager_forward() -> None:
    """Tensor parallelism's all-reduce is a forward hook the static step would skip."""
    target = tiny_model(11)
    target.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert TargetVerifier(target, BUDGET, steps=StepOptions(context=64)).steps is None


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("qwen3", {}),  # q/k norm
        ("olmo2", {}),  # post-norms
        ("gemma3_text", {}),  # GeGLU, sliding and global layers
        ("granite", {"residual_multiplier": 0.5, "embedding_multiplier": 12.0}),
    ],
)
def test_a_family_with_its_own_layer_math_stays_on_the_eager_forward(
    family: str, overrides: dict[str, float]
) -> None:
    """The step computes Llama's layer; another family's math would give other tokens."""
    why = StepRunner.unsupported(tiny_model(3, family, **overrides))
    assert why is not None and family in why


def test_padding_rows_touch_no_session_cache(pair: tuple) -> None:
    """A step whose sessions are all padding writes the scratch slot and nothing else."""
    step, (bucket, ints, floats) = step_and_inputs(pair[0], Bucket(2, 3, False))
    step.clear(bucket, ints, floats)
    before = [c.clone() for c in step.k_caches]
    out = step(bucket, ints, floats)
    assert out[:, 0].tolist() == [0, 0]  # no drafts, none accepted
    for a, b in zip(before, step.k_caches, strict=True):
        assert torch.equal(a[:-1], b[:-1]) and not torch.equal(a[-1], b[-1])


@pytest.mark.parametrize(
    ("top_k", "top_p"), [(0, 1.0), (40, 1.0), (0, 0.9), (40, 0.95), (255, 0.5), (3, 0.99)]
)
def test_static_probabilities_are_the_engines(top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(5, 256, generator=gen) * 3
    logits[0, :4] = logits[0, 4]  # a tie across the k-th value
    params = SamplingParams(0.7, top_k=top_k, top_p=top_p)
    want = batched_probabilities(logits, [params], [5])
    got = probabilities(
        logits,
        torch.full((5,), 0.7),
        torch.full((5,), top_k, dtype=torch.long),
        torch.full((5,), top_p, dtype=torch.float64),
    )
    assert torch.equal(got, want)


# -- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_captured_graphs_give_the_eager_steps_tokens_on_cuda() -> None:
    """The target's and the draft's steps as CUDA graphs: the tokens of the target's
    eager static steps and of target-only decoding (float32), drafts accepted."""
    target = tiny_model(11).cuda()
    draft = noisy_copy(tiny_model(11), noise=0.3, seed=111).cuda()
    params = [GREEDY, coupled(1), GREEDY, coupled(3)]
    base = {"k_max": 4, "context": 256, "sessions": (1, 4)}
    eager, _, _ = decode(target, draft, params, 4, StepOptions(**base, capture=False))
    captured, verifier, drafter = decode(
        target, draft, params, 4, StepOptions(**base), draft_steps=StepOptions(**base)
    )
    assert verifier.steps is not None and verifier.steps.graphs
    assert drafter.steps is not None and drafter.steps.graphs and drafter.steps.runs > 0
    assert verifier.steps.capture_seconds is not None
    assert [s.completion for s in captured] == [s.completion for s in eager]
    plain, _, _ = decode(target, draft, params, 0, None)
    assert [s.completion for s in captured] == [s.completion for s in plain]  # float32
    assert sum(s.stats.accepted for s in captured) > 0


@pytest.mark.gpu
@gpu
def test_batch_invariant_bfloat16_speculation_is_target_only_on_cuda() -> None:
    target = tiny_model(11).to("cuda", torch.bfloat16)
    draft = noisy_copy(tiny_model(11), noise=0.3, seed=111).to("cuda", torch.bfloat16)
    params = [GREEDY] * 4
    steps = StepOptions(k_max=4, context=256, sessions=(4,), batch_invariant=True)
    plain, _, _ = decode(target, draft, params, 0, steps)
    spec, _, _ = decode(target, draft, params, 4, steps)
    assert [s.completion for s in spec] == [p.completion for p in plain]
    assert sum(s.stats.accepted for s in spec) > 0


@pytest.mark.gpu
@gpu
def test_inductor_compiled_steps_give_the_eager_steps_tokens_on_cuda() -> None:
    """torch.compile(fullgraph=True) with inductor, captured as CUDA graphs, against the
    eager static step: the same tokens (float32, greedy and coupled in one batch)."""
    target = tiny_model(11).cuda()
    draft = noisy_copy(tiny_model(11), noise=0.3, seed=111).cuda()
    params = [GREEDY, coupled(1), GREEDY, coupled(3)]
    base = StepOptions(k_max=4, context=256, sessions=(4,), batch_invariant=True)
    eager, _, _ = decode(target, draft, params, 4, replace(base, capture=False))
    compiled, verifier, _ = decode(target, draft, params, 4, replace(base, compile="inductor"))
    assert verifier.steps is not None and verifier.steps.graphs
    assert [s.completion for s in compiled] == [s.completion for s in eager]
