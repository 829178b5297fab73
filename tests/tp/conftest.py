"""Fixtures shared by the TP tests."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from tests.tp import programs
from tests.tp.ranks import run_ranks


@pytest.fixture(scope="session")
def tp2_greedy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Greedy decoding through a torchrun-style TP=2 group (rank 0's TPVerifier)."""
    out = tmp_path_factory.mktemp("greedy")
    codes = run_ranks(programs.greedy_program, 2, out, *programs.GREEDY_CASE.values(), 20.0)
    assert codes == [0, 0]
    return pickle.loads((out / "greedy.pkl").read_bytes())
