"""What a flow run shows on its page in the Prefect UI: a counts table, a markdown summary and a progress
bar that moves while batches run. The content comes from `layertap.report`; this module only publishes."""

from __future__ import annotations

import re
import time

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from layertap.progress import Progress
from layertap.report import counts_table, markdown_summary


def artifact_key(kind: str, dataset: str | None) -> str:
    """Keys group one kind of artifact across runs in the UI; one group per dataset (Prefect allows
    lowercase letters, digits and dashes only)."""
    suffix = re.sub(r"[^a-z0-9-]+", "-", (dataset or "inputs").lower()).strip("-")
    return f"layertap-{kind}-{suffix}"


def publish_counts(summary: dict) -> None:
    create_table_artifact(
        counts_table(summary),
        key=artifact_key("counts", summary.get("dataset")),
        description="Where every input row went, and what was extracted",
    )
    create_markdown_artifact(
        markdown_summary(summary),
        key=artifact_key("summary", summary.get("dataset")),
        description="Run summary: throughput and where the results are",
    )


class ProgressArtifact:
    """The run's progress artifact; created at 0 % once the plan is known, then updated as batches finish,
    at most once per `min_interval_s` and always at the end.

    Each update is a call to Prefect's API on the flow's thread (~80 ms against a local server), which
    hands the next batch to the engine once it returns; a bar that moves every second or two needs no more.
    """

    min_interval_s = 2.0

    def __init__(self, dataset: str | None, prompts: int, batches: int) -> None:
        self.artifact_id = create_progress_artifact(
            0.0 if prompts else 100.0,
            key=artifact_key("progress", dataset),
            description=f"Extraction: {prompts} prompts in {batches} batches",
        )
        self._shown_at = time.monotonic()

    def __call__(self, progress: Progress) -> None:
        last = progress.batches_done >= progress.batches_total
        if not last and time.monotonic() - self._shown_at < self.min_interval_s:
            return
        update_progress_artifact(
            self.artifact_id,
            round(100.0 * progress.fraction, 1),
            description=(
                f"Extraction: {progress.prompts_done}/{progress.prompts_total} prompts, "
                f"{progress.batches_done}/{progress.batches_total} batches"
            ),
        )
        self._shown_at = time.monotonic()
