"""A Verify's budget: its rows times the target's measured seconds per row, never below the
floor, doubled after a miss and eased back as calls come in time."""

from __future__ import annotations

import pytest

from specserve.orchestrator.fleet.verify_budget import MARGIN, VerifyBudget, rows_of


def test_the_floor_holds_until_the_target_is_measured_slow() -> None:
    budget = VerifyBudget(floor_s=60.0)
    assert budget.timeout_s("t", 5) == 60.0  # nothing measured yet
    budget.observe("t", 5, compute_s=0.5)  # 0.1 s a row
    assert budget.timeout_s("t", 5) == 60.0
    assert budget.timeout_s("t", 4000) == pytest.approx(MARGIN * 4000 * 0.1)  # a long prompt
    assert budget.timeout_s("other", 4000) == 60.0  # measured per target


def test_a_slower_host_raises_the_budget_gradually() -> None:
    budget = VerifyBudget(floor_s=1.0)
    budget.observe("t", 10, compute_s=1.0)  # 0.1 s a row
    budget.observe("t", 10, compute_s=11.0)  # the host got busy: 1.1 s a row
    assert budget.per_row_s["t"] == pytest.approx(0.1 + 0.2 * 1.0)
    assert budget.timeout_s("t", 10) == pytest.approx(MARGIN * 10 * 0.3)


def test_a_miss_doubles_and_calls_in_time_ease_it_back() -> None:
    budget = VerifyBudget(floor_s=60.0)
    budget.missed("t")
    budget.missed("t")
    assert budget.timeout_s("t", 5) == 240.0
    budget.observe("t", 5, compute_s=0.01)
    assert budget.timeout_s("t", 5) == 120.0
    budget.observe("t", 5, compute_s=0.01)
    assert budget.timeout_s("t", 5) == 60.0 and "t" not in budget.stretch
    for _ in range(20):
        budget.missed("t")
    assert budget.timeout_s("t", 5) == 60.0 * 64  # bounded
    budget.forget("t")
    assert budget.timeout_s("t", 5) == 60.0


def test_rows_count_what_the_target_computes() -> None:
    assert rows_of([1, 2, 3], drafts=4, steps=1) == 8
    assert rows_of([], drafts=0, steps=6) == 6
