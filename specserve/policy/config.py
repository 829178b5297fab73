"""Every constant of the scheduling policy, in one frozen :class:`PolicyConfig`.

Built once by the orchestrator's config from its flags (``--devices``, ``--k-max``,
``--k-full-below``, ``--k-zero-at``); every other field keeps its default unless an
ablation overrides it with ``SPECSERVE_POLICY=field=value,...`` (:func:`with_overrides`,
applied last: it wins over the flags).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from specserve.policy import round_cost
from specserve.policy.k_policy import ALPHA0, PROBE_EVERY, CostModel
from specserve.policy.plain_steps import MAX_STEPS


class Devices(StrEnum):
    """Whether draft and target share hardware: declared by whoever launched the stack."""

    SHARED = "shared"  # one machine's cores (the dev launcher): both compete for them
    SEPARATE = "separate"  # their own accelerators: a draft step is cheap, a wider verify too


# What drafting costs before any round is timed, in plain rounds (one target forward of
# the batch), by declared devices. Separate: a draft forward about a sixth of a target
# forward, a verify a few tokens wider nearly free. Shared: the float32 draft's costs on
# one CPU (:class:`~specserve.policy.k_policy.CostModel`'s defaults).
PRIOR_COSTS = {
    Devices.SEPARATE: CostModel(draft_per_token=0.17, verify_per_token=0.02, fixed=0.05),
    Devices.SHARED: CostModel(),
}

# The load curve's (full below, zero at) where the flags set neither. On shared cores
# every drafted token of a batch slows the verify, and a draft warm-up or a re-timed
# drafting round stalls every session of it: with the demo pair as it ships (GGUF
# blocks) on two cores, adaptive speculation with drafting allowed up to 2 sessions
# ran 0.89x plain at 2 (bench/results/concurrency.md), so on shared cores only a lone
# session drafts. On separate devices a verify a few tokens wider costs about nothing:
# no bound, the measured cap alone decides (None).
SHARED_CURVE = (1, 2)
CURVE_DEFAULTS: dict[Devices, tuple[int, int] | None] = {
    Devices.SHARED: SHARED_CURVE,
    Devices.SEPARATE: None,
}


# Tokens a round without drafts decodes in one Verify, by declared devices. On
# accelerators a round trip costs 15-40% of a 6-25 ms step, so plain rounds decode 8
# steps each (a new session joins the batch up to 8 steps later). On shared cores a
# step takes 60-700 ms and the round trip about 2% of it: one step, so a new request
# joins at the next step.
PLAIN_STEPS = {Devices.SEPARATE: 8, Devices.SHARED: 1}

# How far re-timing drafting backs off while plain decoding wins, by declared devices.
# Acceptance moves with the text (prose, then code), plain decoding's time does not: on
# accelerators a drafting round of one draft per session costs about a plain step, so
# drafting is re-tried every ``explore_every`` tokens, as the local loop probes. On
# shared cores every drafted token slows the verify: it backs off as plain does.
DRAFTING_BACKOFF = {Devices.SEPARATE: 1, Devices.SHARED: 8}


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """The policy's switches and constants (docs/scheduling.md lists each)."""

    devices: Devices = Devices.SEPARATE
    fixed_k: int | None = None  # every adaptive session drafts this k; None: adaptive
    k_max: int = 8
    curve_full_below: int | None = None  # load up to which the curve allows k_max
    curve_zero_at: int | None = None  # load from which it allows 0 (None: see `curve`)
    alpha0: float = ALPHA0
    alpha_smoothing: float = 0.2
    alpha_prior_trials: float = 8.0  # judged drafts the target's pooled acceptance counts as
    acceptance_decay: float = 0.99  # weight the pool keeps of older rounds at each new round
    cost_decay: float = round_cost.DECAY
    cost_min_rounds: int = round_cost.MIN_ROUNDS
    explore_every: int = PROBE_EVERY  # the local loop's probe interval, here the explorer's
    max_backoff: int = 8
    # max_backoff of re-timing drafting (None: the declared devices' DRAFTING_BACKOFF)
    max_backoff_drafting: int | None = None
    warm_above_tokens: int = 32
    # Tokens a round with no drafts decodes in one Verify (multi-step decoding); None:
    # the declared devices' default (PLAIN_STEPS).
    plain_steps: int | None = None

    def __post_init__(self) -> None:
        # devices given as a string (the override parser, tests) becomes the enum.
        try:
            object.__setattr__(self, "devices", Devices(self.devices))
        except ValueError:
            allowed = "|".join(m.value for m in Devices)
            raise ValueError(f"policy devices must be {allowed}, got {self.devices!r}") from None
        curve = self.curve
        checks = [
            (0 <= self.k_max <= 16, "k_max must be in 0..16"),
            (
                curve is None or 1 <= curve[0] < curve[1],
                f"need 1 <= curve_full_below < curve_zero_at, got {curve}",
            ),
            (self.fixed_k is None or 0 <= self.fixed_k <= 16, "fixed_k must be in 0..16 or none"),
            (0 < self.alpha0 < 1, "alpha0 must be in (0, 1)"),
            (0 < self.alpha_smoothing <= 1, "alpha_smoothing must be in (0, 1]"),
            (self.alpha_prior_trials > 0, "alpha_prior_trials must be > 0"),
            (0 < self.acceptance_decay <= 1, "acceptance_decay must be in (0, 1]"),
            (0 < self.cost_decay <= 1, "cost_decay must be in (0, 1]"),
            (self.cost_min_rounds >= 2, "cost_min_rounds must be >= 2"),
            (self.explore_every >= 2, "explore_every must be >= 2"),
            (self.max_backoff >= 1, "max_backoff must be >= 1"),
            (
                self.max_backoff_drafting is None or self.max_backoff_drafting >= 1,
                "max_backoff_drafting must be >= 1 or none",
            ),
            (self.warm_above_tokens >= 1, "warm_above_tokens must be >= 1"),
            (
                self.plain_steps is None or 1 <= self.plain_steps <= MAX_STEPS,
                f"plain_steps must be in 1..{MAX_STEPS} or none",
            ),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"policy: {why}")

    @property
    def curve(self) -> tuple[int, int] | None:
        """The load curve's (full below, zero at); None: it bounds nothing.

        Neither field set: the declared devices' default (:data:`CURVE_DEFAULTS`). One
        set: the other takes its shared-cores default (:data:`SHARED_CURVE`)."""
        full, zero = self.curve_full_below, self.curve_zero_at
        if full is None and zero is None:
            return CURVE_DEFAULTS[self.devices]
        return (
            SHARED_CURVE[0] if full is None else full,
            SHARED_CURVE[1] if zero is None else zero,
        )

    def curve_cap(self, load: int) -> int:
        """The load curve's bound on k for a target ``load`` sessions decode on: ``k_max``
        up to full-below, 0 from zero-at, linear (rounded down) between; ``k_max`` at
        every load where the curve bounds nothing."""
        curve = self.curve
        if curve is None:
            return self.k_max
        full, zero = curve
        if load <= full:
            return self.k_max
        if load >= zero:
            return 0
        return self.k_max * (zero - load) // (zero - full)

    @property
    def steps_of_plain(self) -> int:
        """Tokens a round without drafts decodes in one Verify (``plain_steps``, or the
        declared devices' default)."""
        return PLAIN_STEPS[self.devices] if self.plain_steps is None else self.plain_steps

    def backoff_of(self, drafting: bool) -> int:
        """The most an exploration of ``drafting`` (or plain) rounds backs off, in
        multiples of ``explore_every``."""
        if not drafting:
            return self.max_backoff
        if self.max_backoff_drafting is None:
            return DRAFTING_BACKOFF[self.devices]
        return self.max_backoff_drafting

    @property
    def prior_costs(self) -> CostModel:
        """What drafting costs before any round is timed, for the declared devices."""
        return PRIOR_COSTS[self.devices]


_OPTIONAL_INTS = ("fixed_k", "curve_full_below", "curve_zero_at", "plain_steps")


def with_overrides(config: PolicyConfig, spec: str) -> PolicyConfig:
    """``config`` with ``field=value,field=value`` applied (``SPECSERVE_POLICY``); an
    unknown field or a bad value raises ValueError with a sentence."""
    fields = {f.name: f for f in dataclasses.fields(PolicyConfig)}
    changes: dict[str, object] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, eq, raw = (x.strip() for x in item.partition("="))
        if not eq or name not in fields:
            known = ", ".join(fields)
            raise ValueError(f"SPECSERVE_POLICY: {item!r} is not field=value, field one of {known}")
        changes[name] = _parse(name, raw, getattr(config, name))
    return dataclasses.replace(config, **changes)  # __post_init__ checks the values


def _parse(name: str, raw: str, current: object) -> object:
    value = raw.lower()
    try:
        if name in _OPTIONAL_INTS:
            return None if value in ("none", "") else int(value)
        if isinstance(current, StrEnum):
            return value
        if isinstance(current, int):
            return int(value)
        return float(value)
    except ValueError:
        raise ValueError(f"SPECSERVE_POLICY: {name}={raw!r} is not a valid value") from None
