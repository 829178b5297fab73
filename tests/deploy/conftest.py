"""Fixtures shared by the deploy checks."""

from __future__ import annotations

import pytest

from tests.deploy.secret_mounts import StandIns


@pytest.fixture(scope="session")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> StandIns:
    """Local files standing in for the Secrets the manifests mount (a test CA, API keys)."""
    return StandIns(tmp_path_factory.mktemp("secrets"))
