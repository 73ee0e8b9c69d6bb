"""The progress bar on a run's page: it moves while batches finish, without an API call for every batch."""

from __future__ import annotations

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

import tasks.artifacts as artifacts
from layertap.progress import Progress
from tasks.artifacts import ProgressArtifact


def _shown(artifact_id) -> float:
    with get_client(sync_client=True) as client:
        (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
    return found.data


@flow
def _bar_after_each(batches: int, min_interval_s: float) -> list[float]:
    """A run's bar fed one report per finished batch (100 prompts each); what it showed after each."""
    bar = ProgressArtifact("test", prompts=100 * batches, batches=batches)
    bar.min_interval_s = min_interval_s
    shown = []
    for done in range(1, batches + 1):
        bar(Progress(done, batches, 100 * done, 100 * batches, seconds=0.01 * done))
        shown.append(_shown(bar.artifact_id))
    return shown


@pytest.fixture
def updates(monkeypatch):
    """How many times the API was asked to update a progress artifact (each call still goes through)."""
    calls = []
    real = artifacts.update_progress_artifact

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(artifacts, "update_progress_artifact", counted)
    return calls


def test_batches_finishing_close_together_update_the_bar_once_and_it_ends_at_100(prefect_harness, updates):
    shown = _bar_after_each(batches=10, min_interval_s=60.0)
    assert shown == [0.0] * 9 + [100.0]  # within the interval nothing is sent; the last batch always is
    assert len(updates) == 1


def test_once_the_interval_has_passed_the_next_batch_is_shown(prefect_harness, updates):
    shown = _bar_after_each(batches=4, min_interval_s=0.0)  # as if every batch took longer than the interval
    assert shown == [25.0, 50.0, 75.0, 100.0]
    assert len(updates) == 4
