"""Devices: names checked against the machine, and the engine's device-generic path.

The device-generic path is what a CUDA device runs: torch ops only, never the CPU
kernels. On a CPU it runs with the kernels turned off (and made to fail the test if
anything still calls them), so its lossless guarantees stay covered without a GPU.
The ``gpu`` tests run the same checks on CUDA and skip without it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from specserve.engine import cpu_kernels, ops
from specserve.engine.decode_state import DecodeState, StopCriteria
from specserve.engine.devices import check_device_name, default_dtype, parse_device
from specserve.engine.errors import InvalidArgument
from specserve.engine.model import CausalLM
from specserve.engine.model_drafter import ModelDrafter
from specserve.engine.sampling import SamplingParams
from specserve.engine.speculative import SpeculativeEngine
from specserve.engine.verifier import TargetVerifier
from specserve.policy.k_policy import KPolicy
from tests.support.tiny import noisy_copy, tiny_model

BUDGET = 8 << 20
N = 32
GREEDY = SamplingParams()
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# -- names -----------------------------------------------------------------------------


def test_cpu_parses_everywhere() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert default_dtype(parse_device("cpu"), "float32") == "float32"


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "mps", "", "cpu:0"])
def test_an_unknown_device_is_one_sentence(name: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^unknown device .*: use cpu, cuda, cuda:N") as e:
        parse_device(name)
    assert "\n" not in str(e.value)
    with pytest.raises(InvalidArgument, match="unknown device"):
        check_device_name(name)


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_refused(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidArgument, match=r"torch\.cuda\.is_available\(\) is false.*--device"):
        parse_device(name)
    assert check_device_name(name) == name  # a launcher may name it for another machine


def test_a_missing_cuda_index_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parse_device("cuda") == torch.device("cuda", 0)
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(InvalidArgument, match=r"sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        parse_device("cuda:2")


def test_cuda_defaults_to_bfloat16() -> None:
    assert default_dtype("cuda", "float32") == "bfloat16"
    assert default_dtype(torch.device("cuda", 1), "float32") == "bfloat16"
    assert default_dtype("cpu", "bfloat16") == "bfloat16"


# -- the device-generic path -----------------------------------------------------------


@pytest.fixture
def device_generic(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CPU kernels off, and any call that still reaches them fails the test."""

    def forbidden() -> None:
        raise AssertionError("the device-generic path called the CPU kernels")

    monkeypatch.setattr(cpu_kernels, "kernels", forbidden)
    with ops.kernels_enabled(False):
        yield


def prompts(count: int = 3) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(4 + 3 * i)] * 3 for i in range(count)]


def decode(
    engine: SpeculativeEngine, params: list[SamplingParams], drafter: str, k: int | None
) -> list[DecodeState]:
    states = [
        DecodeState(f"s{i}", p, sp, StopCriteria(N), KPolicy(k), drafter=drafter)
        for i, (p, sp) in enumerate(zip(prompts(len(params)), params, strict=True))
    ]
    engine.run(states)
    return states


def pair_on(device: str, dtype: torch.dtype = torch.float32) -> tuple[CausalLM, CausalLM]:
    target = tiny_model(11)
    draft = noisy_copy(target, noise=0.3, seed=111)
    return target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)


def check_lossless(target: CausalLM, draft: CausalLM, params: list[SamplingParams]) -> None:
    """Speculative output == target-only output, with drafts proposed and accepted."""
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    plain = decode(engine, params, "none", 0)
    for k in (1, 4, None):
        spec = decode(engine, params, "model", k)
        assert [s.completion for s in spec] == [p.completion for p in plain], f"k={k}"
        assert sum(s.stats.drafted for s in spec) > 0
        assert sum(s.stats.accepted for s in spec) > 0
    assert engine.verifier.kv.device == target.device


def sampled(count: int = 3) -> list[SamplingParams]:
    return [SamplingParams(0.8, top_k=40, top_p=0.95, seed=77 + i) for i in range(count)]


def test_greedy_speculation_is_lossless_on_the_device_generic_path(device_generic: None) -> None:
    check_lossless(*pair_on("cpu"), [GREEDY] * 3)


def test_coupled_sampling_is_lossless_on_the_device_generic_path(device_generic: None) -> None:
    check_lossless(*pair_on("cpu"), sampled())


def test_the_device_generic_path_samples_what_the_kernels_sample() -> None:
    """Same seed, same device type, same dtype: with or without the kernels a CPU draws
    the same tokens here (the coupled argmax is one exact function either way, and tiny
    models' top logits are far from ties)."""
    if cpu_kernels.kernels() is None:
        pytest.skip("the CPU kernels do not build here")
    target, draft = pair_on("cpu")
    engine = SpeculativeEngine(
        TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
    )
    with_kernels = [s.completion for s in decode(engine, sampled(), "model", 4)]
    with ops.kernels_enabled(False):
        assert [s.completion for s in decode(engine, sampled(), "model", 4)] == with_kernels


# -- CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_greedy_speculation_is_lossless_on_cuda() -> None:
    """float32 on CUDA: the claim (docs/devices.md) holds where one-token and k-token
    steps run the same kernels; on tiny models the top logits are far from ties."""
    check_lossless(*pair_on("cuda"), [GREEDY] * 3)


@pytest.mark.gpu
@gpu
def test_seeded_coupled_sampling_on_cuda_reproduces_itself() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        target, draft = pair_on("cuda", dtype)
        engine = SpeculativeEngine(
            TargetVerifier(target, BUDGET), {"model": ModelDrafter(draft, BUDGET)}
        )
        first = decode(engine, sampled(), "model", 4)
        again = decode(engine, sampled(), "model", 4)
        assert [s.completion for s in again] == [s.completion for s in first], dtype
        assert sum(s.stats.accepted for s in first) > 0
        assert engine.verifier.kv.device.type == "cuda"
