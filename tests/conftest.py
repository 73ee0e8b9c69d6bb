"""Fixtures shared by the whole suite: a clean environment, one Prefect test server, one tiny model."""

from __future__ import annotations

import os

import pytest

from layertap.runner import engine_cache


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No LAYERTAP_* variable or .env from the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("LAYERTAP_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server (real API, SQLite) for the whole test run."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny model at one path for every module, so flows and CLI runs share one engine."""
    from layertap.model.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.getbasetemp() / "shared" / ".layertap" / "tiny-model")


@pytest.fixture(scope="session")
def shared_engine(prefect_harness):
    """Keep engines open across flows for the whole test run; the last pin closes them."""
    with engine_cache.pin():
        yield
