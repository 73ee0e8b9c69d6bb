"""What a run tells people: the counts table and the markdown summary shown on its page in the UI.

Built from the run summary only (plain data in, plain data out), so the CLI, the flows and the tests all
see the same numbers.
"""

from __future__ import annotations


def run_summary(
    *, dataset: str | None, store: str, model: str, extraction_id: str, layers: list[int], dimension: int,
    ledger: dict, seconds: float, new_rows: int = 0, normalised: dict | None = None, planned: int = 0,
    batches: int = 0, embedded: int = 0, refused: int = 0, tokens: int = 0, extract_seconds: float = 0.0,
    engine: dict | None = None, quarantined: list | None = None,
) -> dict:
    """What a run did, as the CLI prints it, the run's page shows it and the store's history keeps it.
    Left at their defaults, the counts describe a run that found nothing new."""
    normalised = normalised or {}
    rejected = dict(normalised.get("rejected") or {})
    return {
        "dataset": dataset,
        "rows": ledger["rows"],
        "new_rows": new_rows,
        "new_prompts": normalised.get("new_prompts", 0),
        "duplicates": normalised.get("duplicates", 0),
        "rejected": sum(rejected.values()),
        "refused": refused,
        "planned": planned,
        "batches": batches,
        "embedded": embedded,
        "skipped": ledger["embedded"] - embedded,
        "tokens": tokens,
        "extract_seconds": round(extract_seconds, 3),
        **(engine or {"engine_busy_seconds": None, "engine_idle_seconds": None}),
        "layers": layers,
        "dimension": dimension,
        "store": store,
        "model": model,
        "extraction_id": extraction_id,
        "ledger": ledger,
        "quarantined": quarantined or [],
        "seconds": round(seconds, 3),
    }


def counts_table(summary: dict) -> list[dict]:
    """One row per count; every input row lands in exactly one of embedded, duplicate and rejected."""
    ledger = summary.get("ledger") or {}
    rows = [
        ("input rows", summary["rows"], "rows of the input files (in this run's scope)"),
        ("new rows", summary["new_rows"], "rows not seen by an earlier run"),
        ("new prompts", summary["new_prompts"], "distinct normalised texts not seen before"),
        ("skipped by cache", summary["skipped"], "prompts already in the store with every requested layer"),
        ("duplicates", ledger.get("duplicate", summary["duplicates"]), "rows whose prompt another row carries"),
    ]
    reasons = dict(ledger.get("reasons") or {})
    rows.append(("rejected", ledger.get("rejected", summary["rejected"]), "rows with no vector, by reason below"))
    for reason, n in sorted(reasons.items()):
        rows.append((f"rejected: {reason}", n, ""))
    rows += [
        ("embedded", summary["embedded"], "prompts extracted and published by this run"),
        ("embedded in store", ledger.get("embedded", 0), "rows in scope whose prompt has every layer"),
        ("layers", len(summary["layers"]), ",".join(map(str, summary["layers"]))),
        ("dimension", summary["dimension"], "values per vector"),
    ]
    return [{"count": name, "value": value, "meaning": meaning} for name, value, meaning in rows]


def throughput(summary: dict) -> tuple[float, float]:
    """(prompts/s, tokens/s) over the extraction phase's wall time (extract, write, validate and publish of
    overlapping batches); 0 when nothing was extracted."""
    seconds = summary.get("extract_seconds") or 0.0
    if seconds <= 0:
        return 0.0, 0.0
    return summary["embedded"] / seconds, summary.get("tokens", 0) / seconds


def markdown_summary(summary: dict) -> str:
    prompts_s, tokens_s = throughput(summary)
    scope = f"dataset `{summary['dataset']}`" if summary.get("dataset") else "the given inputs"
    ledger = summary.get("ledger") or {}
    lines = [
        f"# layertap: {summary['embedded']} prompts embedded for {scope}",
        "",
        f"- **Rows**: {summary['rows']} input rows ({summary['new_rows']} new): "
        f"{ledger.get('embedded', 0)} embedded, {ledger.get('duplicate', 0)} duplicates, "
        f"{ledger.get('rejected', 0)} rejected, {ledger.get('pending', 0)} pending",
        f"- **Work**: {summary['planned']} prompts planned in {summary['batches']} batches, "
        f"{summary['skipped']} skipped (already embedded)",
    ]
    if summary["embedded"]:
        lines.append(
            f"- **Throughput**: {prompts_s:,.1f} prompts/s, {tokens_s:,.0f} tokens/s "
            f"({summary['extract_seconds']:.2f} s extracting and publishing, {summary['seconds']:.1f} s in all)"
        )
    else:
        lines.append(f"- **Throughput**: nothing to extract ({summary['seconds']:.1f} s in all)")
    if summary.get("engine_busy_seconds"):
        lines.append(
            f"- **Engine**: computing {summary['engine_busy_seconds']:.2f} s, waiting for the host's work on "
            f"earlier batches {summary['engine_idle_seconds']:.2f} s of the extraction phase"
        )
    lines += [
        f"- **Layers**: {','.join(map(str, summary['layers']))}, dimension {summary['dimension']}",
        f"- **Model**: `{summary['model']}`",
        f"- **Results**: store `{summary['store']}`, extraction `{summary['extraction_id']}`",
        "",
        "Read them:",
        "",
        "```python",
        "from layertap import Store",
        f"table = Store({summary['store']!r}).embeddings(layer={summary['layers'][-1]})",
        "```",
        "",
        f"or `layertap export --store {summary['store']} --layer {summary['layers'][-1]} --format npy --output DIR`.",
    ]
    return "\n".join(lines)
