"""The store: one DuckDB file (rows, prompts, plans, the manifest of published parts) beside the Parquet parts.

By stage: `inputs` and `careful_reader` read input files, `normalise` holds the normalisation rules,
`ingest` turns files into rows and rows into prompts, `plan` cuts the work into batches, `publish` makes
validated parts visible, `ledger` accounts for every input row, `reader` is the read-only `Store`.
`schema` owns the tables and their upgrades; `store_db` assembles the writer (`StoreDB`). Around them:
`lock` (one writer per store), `registry` (datasets and run history), `up_to_date` (runs with nothing to
do), `disk_space`, `check` (a whole store after the fact) and `export`.
"""
