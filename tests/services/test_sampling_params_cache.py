"""SamplingConfig -> SamplingParams: a repeated config is shared, a bad one refused each time."""

from __future__ import annotations

import pytest

from specserve.engine.errors import InvalidArgument
from specserve.engine.sampling import SamplingRule
from specserve.v1 import common_pb2
from specserve.wire import common_wire


def test_a_repeated_config_gives_the_same_params() -> None:
    pb = common_pb2.SamplingConfig(temperature=0.7, top_k=5, seed=11)
    first = common_wire.sampling_params(pb, "a")
    again = common_wire.sampling_params(
        common_pb2.SamplingConfig(temperature=0.7, top_k=5, seed=11), "b"
    )
    assert again is first
    assert (first.temperature, first.top_k, first.top_p, first.seed) == (
        pytest.approx(0.7),
        5,
        1.0,
        11,
    )
    assert first.rule is SamplingRule.COUPLED
    other = common_wire.sampling_params(
        common_pb2.SamplingConfig(temperature=0.7, top_k=5, seed=12), "c"
    )
    assert other.seed == 12


@pytest.mark.parametrize(
    "pb",
    [
        common_pb2.SamplingConfig(temperature=-1.0),
        common_pb2.SamplingConfig(temperature=float("nan")),
        common_pb2.SamplingConfig(top_p=1.5),
        common_pb2.SamplingConfig(rule=99),  # type: ignore[arg-type]
    ],
)
def test_a_bad_config_is_refused_every_time_naming_the_session(
    pb: common_pb2.SamplingConfig,
) -> None:
    for sid in ("first", "second"):
        with pytest.raises(InvalidArgument) as refused:
            common_wire.sampling_params(pb, sid)
        assert str(refused.value).startswith(f"session {sid!r}: ")
        assert str(refused.value).count("session") == 1
