"""Normalise and deduplicate rows into prompts, in SQL inside the store."""

from __future__ import annotations

from dataclasses import asdict

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from layertap.store.normalise import NormaliseRules
from layertap.store.store_db import StoreDB


@task(name="normalise", cache_policy=NO_CACHE, result_serializer="json")
def normalise(store: str, remove_period: bool) -> dict:
    """Only rows not yet normalised under these rules are touched, so reruns are cheap."""
    rules = NormaliseRules(remove_period=remove_period)
    report = asdict(StoreDB(store).normalise(rules))
    report["rules_id"] = rules.rules_id
    rejected = report.get("rejected") or {}
    get_run_logger().info(
        "normalise (%s): %d rows, %d new prompts, %d duplicates, %d rejected%s",
        rules.rules_id,
        report["rows"],
        report["new_prompts"],
        report["duplicates"],
        sum(rejected.values()),
        "".join(f"; {reason}: {n}" for reason, n in sorted(rejected.items())),
    )
    return report
