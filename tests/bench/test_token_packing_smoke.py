"""bench.token_packing runs, and both wire forms carry the same tokens."""

from __future__ import annotations

import pytest

from bench import token_packing


def test_both_forms_round_trip_and_are_timed() -> None:
    data = token_packing.sessions(3, 2, 4)
    raw_r = token_packing.encode_repeated(data)
    raw_p = token_packing.encode_packed(data)
    assert token_packing.decode_repeated(raw_r) == token_packing.decode_packed(raw_p) == data
    rows = token_packing.measure(reps=5)
    assert set(rows) == set(token_packing.CASES)
    for row in rows.values():
        assert row["repeated_total_us"] > 0 and row["packed_total_us"] > 0
        assert row["packed_bytes"] > 0 and row["repeated_bytes"] > 0
    ratios = token_packing.headline(rows)
    assert set(ratios) == set(rows) and all(r > 0 for r in ratios.values())


def test_packed_tokens_must_be_whole_int32s() -> None:
    with pytest.raises(ValueError, match="whole int32s"):
        token_packing.unpack(b"\x01\x00\x00")
