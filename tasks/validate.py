"""The end-of-run check that the store holds exactly what the run was asked for."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.errors import ValidationError as CheckFailed
from layertap.store import StoreDB


@task(name="validate-store", cache_policy=NO_CACHE)
def validate_store(store: str, rules_id: str, extraction_id: str, layers: list[int]) -> dict:
    """One result per planned prompt and layer, and a ledger that accounts for every input row."""
    counts = StoreDB(store).ledger_counts(rules_id, extraction_id, list(layers))
    statuses = ("embedded", "duplicate", "rejected", "pending")
    accounted = sum(int(counts.get(s, 0)) for s in statuses)
    if counts.get("pending"):
        raise CheckFailed(
            f"validate-store: {counts['pending']} rows still lack a result for some of layers "
            f"{','.join(map(str, layers))}"
        )
    if "rows" in counts and accounted != counts["rows"]:
        raise CheckFailed(f"validate-store: ledger accounts for {accounted} of {counts['rows']} input rows")
    get_run_logger().info(
        "validate store: %s",
        ", ".join(f"{k} {v}" for k, v in counts.items() if not isinstance(v, dict)),
    )
    return counts
