"""Ingest and normalise: input files become rows (one per input row), rows become prompts (one per
prompt_hash) under a set of normalisation rules.

Both are set-shaped SQL over whole tables, so a million rows cost seconds and Python only moves ids and
counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from layertap import faults
from layertap.store.careful_reader import CarefulRows
from layertap.store.inputs import (
    READERS,
    ScanRefused,
    drop_rejects,
    expand_inputs,
    file_sha256,
    next_reader,
    record_malformed,
    row_source_sql,
)
from layertap.store.normalise import REJECT_EMPTY, REJECT_NUL, REJECT_NULL, NormaliseRules
from layertap.store.schema import one


@dataclass(frozen=True)
class IngestReport:
    sources_read: int
    sources_skipped: int
    rows_total: int
    rows_new: int
    sources: list[str]
    # One line per CSV file with lines DuckDB could not parse: how many (each a rejected row), the first's line.
    malformed: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NormaliseReport:
    """`rows` = `new_prompts` + `duplicates` + sum(`rejected`) for the rows normalised by this call."""

    rows: int
    new_prompts: int
    duplicates: int
    rejected: dict[str, int]



class Ingest:
    """Ingest and normalise, for `StoreDB`."""

    def ingest(self, paths: list[str], text_column: str) -> IngestReport:
        """Record every row of the given files; unchanged files are skipped, changed ones replace their rows.

        All files are checked (readable, has the column) before any is written, so a typo fails fast.
        """
        files = expand_inputs(paths)
        read = skipped = total = new = 0
        malformed: list[str] = []
        with self._connect() as con:
            changed = []
            for path in files:
                fingerprint = file_sha256(path)
                known = one(
                    con, "SELECT fingerprint, text_column, num_rows FROM sources WHERE source = ?", [path]
                )
                if known is not None and known[:2] == (fingerprint, text_column):
                    skipped += 1
                    total += known[2]
                    continue
                try:
                    changed.append((path, fingerprint, row_source_sql(con, path, text_column)))
                except ScanRefused as refused:
                    changed.append((path, fingerprint, next_reader(con, path, text_column, refused)))
            for path, fingerprint, source in changed:
                n, note = self._replace_rows(con, path, fingerprint, text_column, source)
                if note:
                    malformed.append(note)
                faults.hit("ingest.committed")
                read += 1
                total += n
                new += n
        return IngestReport(
            sources_read=read, sources_skipped=skipped, rows_total=total, rows_new=new, sources=files,
            malformed=malformed,
        )

    def changed_sources(self, paths: list[str], text_column: str) -> list[str]:
        """The input files `ingest` would read: new to the store, changed since, or read for another column."""
        files = expand_inputs(paths)
        with self._connect() as con:
            known = {source: (fingerprint, column) for source, fingerprint, column in con.execute(
                "SELECT source, fingerprint, text_column FROM sources WHERE list_contains($files, source)",
                {"files": files}).fetchall()}
        return [path for path in files if known.get(path) != (file_sha256(path), text_column)]

    def rows_to_normalise(self, rules: NormaliseRules, sources: list[str]) -> int:
        """Rows of `sources` that `normalise` has not yet given a prompt (or a reason) under these rules."""
        with self._connect() as con:
            return one(con, """SELECT count(*) FROM rows r ANTI JOIN (SELECT source, row_number FROM row_prompts
                                                             WHERE rules_id = $rules) d
                                ON r.source = d.source AND r.row_number = d.row_number
                                WHERE list_contains($sources, r.source)""",
                        {"rules": rules.rules_id, "sources": sources})[0]

    @staticmethod
    def _replace_rows(
        con: duckdb.DuckDBPyConnection, path: str, fingerprint: str, text_column: str, source
    ) -> tuple[int, str | None]:
        """Swap one file's rows in one transaction; returns how many, and a line about the CSV lines DuckDB
        could not parse (each kept as a rejected row) if there were any. A scan DuckDB refuses as a whole
        falls back to the next reader (`next_reader`), the last being the careful reader, which keeps every
        row and marks the bad ones."""
        while True:
            con.begin()
            note = None
            try:
                con.execute("DELETE FROM rows WHERE source = $path", {"path": path})
                con.execute("DELETE FROM row_prompts WHERE source = $path", {"path": path})
                if isinstance(source, CarefulRows):
                    con.register("careful_rows", source.reader())
                    try:
                        n = one(con, "INSERT INTO rows SELECT $path, row_number, text, reject FROM careful_rows",
                                 {"path": path})[0]
                    finally:
                        con.unregister("careful_rows")
                else:
                    n = one(con, f"INSERT INTO rows SELECT $path, row_number, text, reject FROM ({source.sql})",
                             source.params)[0]
                    if source.rejects:
                        malformed, note = record_malformed(con, path, source.rejects)
                        n += malformed
                        drop_rejects(con, source.rejects)
                faults.hit("ingest.before-commit")
                con.execute(
                    "INSERT OR REPLACE INTO sources VALUES (?, ?, ?, ?, now())", [path, fingerprint, text_column, n]
                )
                con.commit()
                return n, note
            except duckdb.Error as exc:
                con.rollback()
                if isinstance(source, CarefulRows):
                    if source.error is not None:  # the reader's own one-line reason, not DuckDB's wrapping of it
                        raise source.error from None
                    raise ScanRefused(source.kind, exc).as_input_error(path) from None
                if source.rejects:
                    drop_rejects(con, source.rejects)
                source = next_reader(con, path, text_column, ScanRefused(READERS[Path(path).suffix.lower()], exc),
                                      source)

    def normalise(self, rules: NormaliseRules) -> NormaliseReport:
        """Give every row not yet seen under these rules its prompt (or reject reason); add new prompts.

        New prompts are inserted sorted by hash: a batch is a run of consecutive hashes, so its prompts sit
        in one or two row groups and `batch_prompts` reads those instead of the whole table.
        """
        with self._connect() as con:
            con.begin()
            con.execute(
                f"""CREATE TEMP TABLE fresh AS
                SELECT source, row_number, text, CASE WHEN reject IS NULL THEN sha256(text) END AS prompt_hash,
                       reject
                FROM (SELECT source, row_number, text,
                             CASE WHEN input_reject IS NOT NULL THEN input_reject
                                  WHEN text IS NULL THEN $null
                                  WHEN strpos(text, chr(0)) > 0 THEN $nul
                                  WHEN text = '' THEN $empty END AS reject
                      FROM (SELECT r.source, r.row_number, r.input_reject, {rules.sql("r.raw_text")} AS text
                            FROM rows r ANTI JOIN (SELECT source, row_number FROM row_prompts
                                                   WHERE rules_id = $rules) d
                            ON r.source = d.source AND r.row_number = d.row_number))""",
                {"rules": rules.rules_id, "null": REJECT_NULL, "nul": REJECT_NUL, "empty": REJECT_EMPTY},
            )
            con.execute(
                "INSERT INTO row_prompts SELECT $rules, source, row_number, prompt_hash, reject FROM fresh",
                {"rules": rules.rules_id},
            )
            new_prompts = one(
                con,
                """INSERT INTO prompts
                SELECT prompt_hash, any_value(text) FROM fresh f
                WHERE prompt_hash IS NOT NULL
                  AND NOT EXISTS (SELECT 1 FROM prompts p WHERE p.prompt_hash = f.prompt_hash)
                GROUP BY prompt_hash ORDER BY prompt_hash""",
            )[0]
            rows = one(con, "SELECT count(*) FROM fresh")[0]
            rejected = dict(
                con.execute("SELECT reject, count(*) FROM fresh WHERE reject IS NOT NULL GROUP BY reject").fetchall()
            )
            faults.hit("normalise.before-commit")
            con.commit()
        faults.hit("normalise.committed")
        return NormaliseReport(
            rows=rows, new_prompts=new_prompts, duplicates=rows - sum(rejected.values()) - new_prompts,
            rejected=rejected,
        )
