"""Publishing: a batch's written, fsynced Parquet parts become visible to readers in one DuckDB
transaction, or none of them do; with them, the prompts the engine refused or noted.

Also what the store does with batches that never publish: quarantine, and sweeping unpublished files.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import duckdb
import pyarrow as pa

from layertap import faults
from layertap.errors import StoreError
from layertap.store.ledger import sorted_layers
from layertap.store.schema import one


@dataclass(frozen=True)
class Publication:
    """One batch's results to make visible: its written files, (part id, path, prompt hashes) each, and the
    prompts the engine refused (with the reason) or noted (e.g. truncated)."""

    extraction_id: str
    layers: list[int]
    files: list[tuple[str, str, list[str]]]
    rejected: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def hashes(self) -> list[str]:
        return [h for _, _, hashes in self.files for h in hashes]


def part_path(root: Path, relpath: str) -> Path:
    """Where a part named in the manifest lies: always under the store's `parts/`, whatever the manifest
    says (an edited or corrupted manifest never makes layertap read or write elsewhere)."""
    path = (root / relpath).resolve()
    if not path.is_relative_to((root / "parts").resolve()):
        raise StoreError(f"{root}: the manifest names {relpath!r}, which is not inside the store's parts/")
    return path


def _check_files(root: Path, files: list[tuple[str, str, list[str]]]) -> None:
    """A batch's files each exist in the store and list prompts, no prompt twice across them."""
    for part_id, relpath, hashes in files:
        if not hashes:
            raise StoreError(f"part {part_id}: prompt hashes must be non-empty and distinct")
        if not part_path(root, relpath).is_file():
            raise StoreError(f"part {part_id}: {relpath} is not a file in the store")
    every_hash = [h for _, _, hashes in files for h in hashes]
    if len(set(every_hash)) != len(every_hash):
        part_ids = [part_id for part_id, _, _ in files]
        what = f"part {part_ids[0]}" if len(files) == 1 else f"parts {', '.join(part_ids)}"
        raise StoreError(f"{what}: prompt hashes must be non-empty and distinct")


def _check_disjoint(publications: list[Publication]) -> None:
    """Batches published together never give one prompt the same layer twice (the store is checked in SQL)."""
    for i, first in enumerate(publications):
        for second in publications[i + 1:]:
            if first.extraction_id != second.extraction_id or not set(first.layers) & set(second.layers):
                continue
            if set(first.hashes()) & set(second.hashes()):
                raise StoreError(f"parts {first.files[0][0]} and {second.files[0][0]} share prompts and layers")


def _insert_once(con: duckdb.DuckDBPyConnection, table: str, texts: list[tuple[str, dict[str, str]]]) -> int:
    """Insert (extraction, prompt_hash, text) rows into `table`, keeping a prompt's first text only."""
    rows: dict[tuple[str, str], str] = {}
    for extraction_id, by_hash in texts:
        for prompt_hash, text in by_hash.items():
            rows.setdefault((extraction_id, prompt_hash), text)
    if not rows:
        return 0
    con.register("incoming", pa.table({
        "extraction_id": pa.array([eid for eid, _ in rows], pa.string()),
        "prompt_hash": pa.array([h for _, h in rows], pa.string()),
        "text": pa.array(list(rows.values()), pa.string()),
    }))
    try:
        return one(
            con,
            f"""INSERT INTO {table}
            SELECT i.extraction_id, i.prompt_hash, i.text FROM incoming i
            WHERE NOT EXISTS (SELECT 1 FROM {table} x
                              WHERE x.extraction_id = i.extraction_id AND x.prompt_hash = i.prompt_hash)""",
        )[0]
    finally:
        con.unregister("incoming")


class Publishing:
    """Publishing, quarantine and the staging sweep, for `StoreDB`."""

    _publish_lock = threading.Lock()

    def publish_part(
        self, extraction_id: str, part_id: str, relpath: str, layers: list[int], prompt_hashes: list[str]
    ) -> None:
        """Make one written file visible, in one transaction; refuses any (prompt, layer) already published."""
        self.publish_parts(extraction_id, layers, [(part_id, relpath, prompt_hashes)])

    def publish_parts(self, extraction_id: str, layers: list[int], files: list[tuple[str, str, list[str]]]) -> None:
        """Make a batch's written files, (part id, path, prompt hashes) each, visible together in one
        transaction: all of them or, on any refusal, none. Refuses any (prompt, layer) already published."""
        if not files:
            raise StoreError("no parts to publish")
        self.publish([Publication(extraction_id, layers, files)])

    def publish(self, publications: list[Publication]) -> None:
        """Make several batches' results visible in one transaction: all of them or, on any refusal, none.

        One transaction for many batches on purpose: each statement can wait milliseconds for Python's lock
        while vLLM's engine loop computes in this process, so a flow that falls behind publishes what is
        ready at once instead of paying those waits per batch.
        """
        publications = [replace(p, layers=sorted_layers(p.layers)) for p in publications]
        part_ids = [part_id for p in publications for part_id, _, _ in p.files]
        if len(set(part_ids)) != len(part_ids):
            raise StoreError(f"part ids must be distinct, got {part_ids}")
        for p in publications:
            _check_files(self.root, p.files)
        _check_disjoint(publications)
        published = [p for p in publications if p.files]
        new = pa.table({
            "part_id": pa.array([part_id for p in published for part_id, _, hashes in p.files for _ in hashes],
                                pa.string()),
            "prompt_hash": pa.array([h for p in published for _, _, hashes in p.files for h in hashes], pa.string()),
        })
        new_parts = pa.table({
            "part_id": pa.array([part_id for p in published for part_id, _, _ in p.files], pa.string()),
            "extraction_id": pa.array([p.extraction_id for p in published for _ in p.files], pa.string()),
            "relpath": pa.array([relpath for p in published for _, relpath, _ in p.files], pa.string()),
            "layers": pa.array([p.layers for p in published for _ in p.files], pa.list_(pa.int32())),
            "num_prompts": pa.array([len(hashes) for p in published for _, _, hashes in p.files], pa.int64()),
        })
        with self._publish_lock, self._connect() as con:
            num_layers = dict(con.execute(
                "SELECT extraction_id, num_layers FROM extractions WHERE list_contains($eids, extraction_id)",
                {"eids": sorted({p.extraction_id for p in publications})},
            ).fetchall())
            for p in publications:
                if p.extraction_id not in num_layers:
                    raise StoreError(f"unknown extraction {p.extraction_id}")
                top = num_layers[p.extraction_id]
                if p.layers[0] < 0 or p.layers[-1] > top:
                    what = f"part {p.files[0][0]}" if p.files else "rejected prompts"
                    raise StoreError(f"{what}: layers must be within 0..{top}, got {p.layers}")
            con.begin()
            if published:
                con.register("new_part", new)
                con.register("new_parts", new_parts)
                known, unknown, unknown_part, clash, clash_part = one(
                    con,
                    """SELECT
                        (SELECT min(part_id) FROM parts WHERE part_id IN (SELECT part_id FROM new_parts)),
                        (SELECT count(*) FROM new_part n ANTI JOIN prompts p USING (prompt_hash)),
                        (SELECT min(part_id) FROM new_part n ANTI JOIN prompts p USING (prompt_hash)),
                        c.n, c.part
                    FROM (SELECT count(*) AS n, min(n.part_id) AS part FROM new_part n
                          JOIN new_parts np ON n.part_id = np.part_id
                          JOIN part_prompts pp ON n.prompt_hash = pp.prompt_hash
                          JOIN parts p ON pp.part_id = p.part_id
                          WHERE p.extraction_id = np.extraction_id AND list_has_any(p.layers, np.layers)) c""",
                )
                if known is not None:
                    raise StoreError(f"part {known} is already published")
                if unknown:
                    raise StoreError(f"part {unknown_part}: {unknown} prompt hashes are not in the store")
                if clash:
                    layers = next(p.layers for p in published for part_id, _, _ in p.files if part_id == clash_part)
                    raise StoreError(f"part {clash_part}: {clash} prompts already have some of layers {layers}")
                con.execute("INSERT INTO parts SELECT part_id, extraction_id, relpath, layers, num_prompts, now() "
                            "FROM new_parts")
                con.execute("INSERT INTO part_prompts SELECT part_id, prompt_hash FROM new_part")
            _insert_once(con, "prompt_rejects", [(p.extraction_id, p.rejected) for p in publications])
            _insert_once(con, "prompt_notes", [(p.extraction_id, p.notes) for p in publications])
            faults.hit("publish.before-commit")
            con.commit()
        faults.hit("publish.committed")

    def reject_prompts(self, extraction_id: str, reasons: dict[str, str]) -> int:
        """Record prompts the engine refused (e.g. too long), so plans skip them and the ledger says why;
        a prompt keeps its first reason. Runs record them with their batch's files (`publish`)."""
        if not reasons:
            return 0
        # The same lock as publishing: a check-then-insert from two threads at once would record twice.
        with self._publish_lock, self._connect() as con:
            return _insert_once(con, "prompt_rejects", [(extraction_id, reasons)])

    def quarantine_batch(self, batch_id: str, extraction_id: str, error: str) -> None:
        """Remember a batch that kept failing; its prompts stay planned, so the next run tries them again."""
        with self._connect() as con:
            con.execute(
                "INSERT OR REPLACE INTO quarantined VALUES (?, ?, ?, now())", [batch_id, extraction_id, error]
            )

    def sweep_staging(self, min_age_s: float = 3600.0) -> int:
        """Delete files no reader can see: staged leftovers and unpublished parts older than `min_age_s`.

        The age guard keeps files of batches still being written or about to be published.
        """
        faults.hit("sweep")
        with self._connect() as con:
            published = {row[0] for row in con.execute("SELECT path FROM parts").fetchall()}
        cutoff = time.time() - min_age_s
        removed = 0
        for path in [*(self.root / "staging").rglob("*"), *(self.root / "parts").rglob("*")]:
            relpath = path.relative_to(self.root).as_posix()
            if path.is_file() and relpath not in published and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        return removed
