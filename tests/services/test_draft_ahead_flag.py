"""``--draft-ahead``: parsed from the flag or SPECSERVE_DRAFT_AHEAD, validated, off by default."""

from __future__ import annotations

import argparse

import pytest

from specserve.draft_service import config as draft_config
from specserve.engine.errors import InvalidArgument


def config(argv: list[str], env: dict[str, str] | None = None) -> draft_config.DraftServerConfig:
    parser = argparse.ArgumentParser()
    draft_config.add_arguments(parser, env or {})
    return draft_config.from_args(parser.parse_args(argv))


def test_off_by_default_and_set_by_flag_or_environment() -> None:
    assert config(["--model", "tiny:1"]).draft_ahead == 0
    assert config(["--model", "tiny:1", "--draft-ahead", "9"]).draft_ahead == 9
    env = {"SPECSERVE_DRAFT": "tiny:1", "SPECSERVE_DRAFT_AHEAD": "5"}
    assert config([], env).draft_ahead == 5
    assert config(["--draft-ahead", "0"], env).draft_ahead == 0  # a flag beats the environment


@pytest.mark.parametrize("value", ["-1", "18", "100"])
def test_out_of_range_is_refused_with_the_range(value: str) -> None:
    with pytest.raises(
        InvalidArgument, match=r"bad draft server flags: draft_ahead must be in \[0, 17\]"
    ):
        config(["--model", "tiny:1", "--draft-ahead", value])


def test_an_ngram_only_replica_refuses_it() -> None:
    with pytest.raises(InvalidArgument, match="draft_ahead needs a draft model"):
        config(["--draft-ahead", "4"])
    assert config(["--draft-ahead", "0"]).model is None


def test_a_non_integer_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        config(["--model", "tiny:1", "--draft-ahead", "many"])
    with pytest.raises(SystemExit):
        config([], {"SPECSERVE_DRAFT": "tiny:1", "SPECSERVE_DRAFT_AHEAD": "lots"})
