"""Derived tables go to a per-test cache folder, not the user's ~/.cache/sixfold."""

from __future__ import annotations

import pytest

from sixfold.backends.host.derived_cache import CACHE_ENV


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("sixfold-cache")))
