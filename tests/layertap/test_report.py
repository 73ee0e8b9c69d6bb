"""The counts table and markdown summary a run publishes."""

from layertap.report import counts_table, markdown_summary, throughput

SUMMARY = {
    "dataset": "reviews", "rows": 14, "new_rows": 4, "new_prompts": 2, "duplicates": 2, "rejected": 0,
    "planned": 2, "batches": 1, "embedded": 2, "skipped": 8, "tokens": 50, "extract_seconds": 0.5,
    "layers": [0, 4], "dimension": 128, "store": "/s", "model": "/m", "extraction_id": "e" * 16, "seconds": 3.0,
    "ledger": {"rows": 14, "embedded": 10, "duplicate": 3, "rejected": 1, "pending": 0,
               "reasons": {"empty after normalisation": 1}},
}


def test_counts_table_accounts_for_every_row():
    table = {row["count"]: row["value"] for row in counts_table(SUMMARY)}
    assert table["input rows"] == 14 and table["new rows"] == 4 and table["skipped by cache"] == 8
    assert table["embedded in store"] + table["duplicates"] + table["rejected"] == table["input rows"]
    assert table["rejected: empty after normalisation"] == 1
    assert (table["embedded"], table["layers"], table["dimension"]) == (2, 2, 128)


def test_markdown_says_throughput_and_where_results_are():
    assert throughput(SUMMARY) == (4.0, 100.0)
    text = markdown_summary(SUMMARY)
    assert "2 prompts embedded for dataset `reviews`" in text
    assert "4.0 prompts/s, 100 tokens/s" in text
    assert "store `/s`, extraction `eeeeeeeeeeeeeeee`" in text and "Store('/s').embeddings(layer=4)" in text
    assert "**Engine**" not in text  # a summary without the engine's counters (no vLLM engine) says nothing
    timed = markdown_summary({**SUMMARY, "engine_busy_seconds": 0.41, "engine_idle_seconds": 0.05})
    assert "computing 0.41 s, waiting for the host's work on earlier batches 0.05 s" in timed
    idle = markdown_summary({**SUMMARY, "embedded": 0, "extract_seconds": 0.0})
    assert "nothing to extract" in idle and throughput({**SUMMARY, "extract_seconds": 0}) == (0.0, 0.0)
