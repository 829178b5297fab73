"""PolicyConfig: its checks, the load curve, the SPECSERVE_POLICY overrides and the flags."""

from __future__ import annotations

import argparse

import pytest

from specserve.engine.errors import InvalidArgument
from specserve.orchestrator import config
from specserve.policy import Devices, PolicyConfig, with_overrides


def test_the_load_curve_falls_from_k_max_to_zero() -> None:
    c = PolicyConfig(k_max=8, curve_full_below=4, curve_zero_at=20)
    assert [c.curve_cap(b) for b in (0, 1, 4)] == [8, 8, 8]
    assert c.curve_cap(12) == 4 and c.curve_cap(19) == 0 and c.curve_cap(100) == 0
    caps = [c.curve_cap(b) for b in range(30)]
    assert caps == sorted(caps, reverse=True)  # never rises with load
    with pytest.raises(ValueError, match="curve_full_below"):
        PolicyConfig(curve_full_below=10, curve_zero_at=10)


def test_the_load_curve_by_devices_bounds_nothing_on_separate_devices_unless_set() -> None:
    """Shared cores: k_max for a lone session, 0 from 2. Separate devices: a wider
    verify costs about nothing, so no curve (the measured cap alone decides) unless an
    operator sets a bound (the other then takes its shared default)."""
    shared = PolicyConfig(devices=Devices.SHARED)
    assert shared.curve == (1, 2) and shared.curve_cap(1) == 8 and shared.curve_cap(2) == 0
    separate = PolicyConfig(devices=Devices.SEPARATE)
    assert separate.curve is None
    assert {separate.curve_cap(b) for b in (1, 8, 32, 64, 1000)} == {separate.k_max}
    assert PolicyConfig(curve_zero_at=16).curve == (1, 16)
    with pytest.raises(ValueError, match="curve_full_below"):
        PolicyConfig(curve_full_below=8)  # above the shared zero-at it is paired with
    assert with_overrides(separate, "curve_zero_at=24,curve_full_below=8").curve == (8, 24)
    assert with_overrides(shared, "curve_zero_at=none,curve_full_below=none").curve == (1, 2)


def test_overrides_set_fields_of_every_kind() -> None:
    c = with_overrides(
        PolicyConfig(),
        " fixed_k=3,alpha0=0.8,devices=shared, explore_every=4",
    )
    assert c.fixed_k == 3 and c.alpha0 == 0.8 and c.devices is Devices.SHARED
    assert c.explore_every == 4
    assert with_overrides(c, "fixed_k=none").fixed_k is None
    assert with_overrides(c, "") == c


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("nonsense=1", "not field=value"),
        ("k_max", "not field=value"),
        ("k_max=many", "k_max='many' is not a valid value"),
        ("devices=sometimes", "devices must be shared|separate"),
        ("acceptance_prior=off", "not field=value"),  # no such field
        ("alpha0=1.5", "alpha0 must be in"),
    ],
)
def test_a_bad_override_is_refused_with_a_sentence(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        with_overrides(PolicyConfig(), spec)


def parse(env: dict[str, str], *argv: str) -> config.OrchestratorConfig:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, {"SPECSERVE_TARGET_ENDPOINTS": "t:1", **env})
    return config.from_args(parser.parse_args(list(argv)))


def test_the_orchestrators_flags_and_env_build_the_policy() -> None:
    assert parse({}).policy == PolicyConfig()  # standalone: separate devices, measured cap
    assert parse({}).policy.curve is None  # ... and no load curve
    assert parse({}, "--devices", "shared").policy.curve == (1, 2)
    assert parse({"SPECSERVE_K_FULL_BELOW": "2"}, "--k-zero-at", "8").policy.curve == (2, 8)
    c = parse(
        {"SPECSERVE_DEVICES": "shared", "SPECSERVE_POLICY": "k_max=4"},
        "--k-zero-at",
        "16",
    ).policy
    assert c.devices is Devices.SHARED
    assert c.k_max == 4 and c.curve_zero_at == 16  # the overrides win over --k-max
    with pytest.raises(InvalidArgument, match="--devices must be"):
        parse({"SPECSERVE_DEVICES": "both"})
    with pytest.raises(InvalidArgument, match="SPECSERVE_POLICY"):
        parse({"SPECSERVE_POLICY": "k_maxx=4"})


def test_the_admission_window_and_plain_steps_follow_the_declared_devices() -> None:
    """An idle lane waits 10 ms for company on shared cores (a prefill round there takes
    about a second), 2 ms on accelerators (a round takes 6-25 ms); a round without
    drafts decodes 8 steps there, 1 on shared cores. The flags and env win."""
    separate, shared = parse({}), parse({}, "--devices", "shared")
    assert separate.scheduler.admission_window_s == pytest.approx(0.002)
    assert shared.scheduler.admission_window_s == pytest.approx(0.010)
    assert separate.policy.steps_of_plain == 8 and shared.policy.steps_of_plain == 1
    assert parse({}, "--admission-window-ms", "0").scheduler.admission_window_s == 0
    env = {"SPECSERVE_ADMISSION_WINDOW_MS": "5", "SPECSERVE_PLAIN_STEPS": "4"}
    both = parse(env, "--devices", "shared")
    assert both.scheduler.admission_window_s == pytest.approx(0.005)
    assert both.policy.steps_of_plain == 4
    with pytest.raises(InvalidArgument, match="plain_steps"):
        parse({}, "--plain-steps", "65")
