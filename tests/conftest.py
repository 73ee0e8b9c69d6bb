"""Fixtures shared by the whole suite: a clean environment, one Prefect test server, one tiny model; and the
`slow` mark that keeps the fast lane (`make test-fast`: `pytest -m "not slow"`) free of Prefect servers,
vLLM engines and Ray clusters without marking each test by hand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from layertap.runner import engine_cache


# A test that asks for one of these fixtures starts a Prefect server or a vLLM engine (or a Ray cluster).
SLOW_FIXTURES = frozenset({
    "prefect_harness", "shared_engine",  # this file
    "model_dirs", "engines", "references",  # tests/layertap/runner/runner_fixtures.py
    "served",  # tests/flows/test_warm_runs.py
    "server",  # tests/test_prefect_yaml.py
})
# Tests that start engines or Prefect servers of their own, in this process or in children.
SLOW_TESTS = (
    "tests/test_crash_safety.py",  # 21 `layertap run` children, each with its own Prefect server and engine
    "tests/flows/test_store_turns.py",  # a Prefect server and `layertap serve` of its own
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (SLOW_FIXTURES.intersection(item.fixturenames) or item.get_closest_marker("ray")
                or item.nodeid.startswith(SLOW_TESTS)):
            item.add_marker(pytest.mark.slow)


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


@pytest.fixture
def fresh_python():
    """Runs a script in a fresh interpreter (nothing imported yet, as in a new process of the product's), with
    `env` added to the environment, and returns what it printed; the script failing (or crashing) fails the
    test with its exit status and error output."""

    def run(script: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-3000:]}"
        return done.stdout

    return run
