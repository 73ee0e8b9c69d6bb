"""Planning: the extractions a store knows, and the batches of prompts still lacking a requested layer.

Work = prompts ANTI JOIN results for the extraction key, cut into batches whose ids hash their content, so
planning the same work twice gives the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from layertap import faults
from layertap.errors import StoreError
from layertap.store.extraction_key import ExtractionKey
from layertap.store.ledger import TODO_CTES, sorted_layers, todo_params
from layertap.store.schema import one

# The smallest batch a small run's work is cut into to keep several batches in flight (`StoreDB.plan`).
MIN_FILL_BATCH = 128


@dataclass(frozen=True)
class WorkBatch:
    """A unit of extraction; the prompts live in the `planned` table so tasks pass only the id.

    `prompt_hashes_digest` is the sha256 hex of the batch's prompt hashes joined by "," in order.
    """

    batch_id: str
    extraction_id: str
    layers: list[int]
    prompt_hashes_digest: str
    num_prompts: int


class Planning:
    """Extractions and their plans, for `StoreDB`."""

    def register_extraction(self, key: ExtractionKey) -> str:
        """Idempotent; refuses a key whose model shape disagrees with what was recorded for it."""
        eid = key.extraction_id
        with self._connect() as con:
            known = one(con, "SELECT hidden_size, num_layers FROM extractions WHERE extraction_id = ?", [eid])
            if known is None:
                con.execute(
                    "INSERT INTO extractions VALUES (?, ?, ?, ?, ?, ?, ?, ?, now(), ?, ?)",
                    [eid, key.model_fingerprint, key.model_path, key.pooling, key.dtype, key.rules_id,
                     key.hidden_size, key.num_layers, key.truncate_to, key.stored_dtype],
                )
                faults.hit("register.committed")
            elif known != (key.hidden_size, key.num_layers):
                raise StoreError(
                    f"extraction {eid} was recorded with hidden_size={known[0]}, num_layers={known[1]}; "
                    f"got {key.hidden_size}, {key.num_layers}"
                )
        return eid

    def has_extraction(self, extraction_id: str) -> bool:
        with self._connect() as con:
            return one(con, "SELECT count(*) FROM extractions WHERE extraction_id = ?", [extraction_id])[0] > 0

    def _extraction_rules(self, con: duckdb.DuckDBPyConnection, extraction_id: str) -> tuple[str, int]:
        found = one(con, "SELECT rules_id, num_layers FROM extractions WHERE extraction_id = ?", [extraction_id])
        if found is None:
            raise StoreError(f"unknown extraction {extraction_id}")
        return found

    def plan(
        self, extraction_id: str, layers: list[int], rules_id: str, batch_size: int,
        sources: list[str] | None = None, fill: int = 1,
    ) -> list[WorkBatch]:
        """Batches of prompts lacking some requested layer, grouped by the set of layers they lack.

        Batches hold at most `batch_size` prompts. Work that would fill fewer than `fill` batches is cut into
        `fill` smaller ones (of at least `MIN_FILL_BATCH` prompts), so a small run still keeps `fill` batches
        in flight: one is written while the engine computes the next. Batch ids hash the extraction, the
        layers and the prompt list, so planning the same work twice gives the same batches (and the same
        Prefect cache keys).
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        layers = sorted_layers(layers)
        params = todo_params(rules_id, extraction_id, layers, sources)
        with self._connect() as con:
            if self._extraction_rules(con, extraction_id)[0] != rules_id:
                raise StoreError(f"extraction {extraction_id} was registered with other normalisation rules")
            con.begin()
            con.execute(
                f"""CREATE TEMP TABLE numbered AS
                WITH {TODO_CTES}
                SELECT missing, prompt_hash, row_number() OVER (ORDER BY missing NULLS FIRST, prompt_hash) AS rn
                FROM todo""",
                params,
            )
            pending = one(con, "SELECT count(*) FROM numbered")[0]
            size = min(batch_size, max(MIN_FILL_BATCH, -(-pending // max(fill, 1))))
            con.execute(
                """CREATE TEMP TABLE plan AS
                WITH starts AS (SELECT missing, min(rn) AS start FROM numbered GROUP BY missing)
                SELECT n.missing, (rn - start) // $size AS chunk, CAST((rn - start) % $size AS INTEGER) AS ord,
                       prompt_hash
                FROM numbered n JOIN starts s ON n.missing IS NOT DISTINCT FROM s.missing""",
                {"size": size},
            )
            con.execute(
                """CREATE TEMP TABLE plan_batches AS
                SELECT substr(sha256(concat_ws(':', $eid, array_to_string(layers, ','), digest)), 1, 16)
                       AS batch_id, *
                FROM (SELECT missing, chunk, count(*) AS num_prompts,
                             coalesce(string_split(missing, ',')::INTEGER[], $layers) AS layers,
                             sha256(string_agg(prompt_hash, ',' ORDER BY ord)) AS digest
                      FROM plan GROUP BY missing, chunk)""",
                {"eid": extraction_id, "layers": layers},
            )
            con.execute(
                """INSERT INTO planned
                SELECT b.batch_id, p.ord, p.prompt_hash
                FROM plan p JOIN (SELECT * FROM plan_batches ANTI JOIN batches USING (batch_id)) b
                     ON p.missing IS NOT DISTINCT FROM b.missing AND p.chunk = b.chunk
                ORDER BY b.batch_id, p.ord"""
            )
            con.execute(
                """INSERT INTO batches
                SELECT batch_id, $eid, layers, digest, num_prompts, now()
                FROM plan_batches ANTI JOIN batches USING (batch_id)""",
                {"eid": extraction_id},
            )
            found = con.execute(
                "SELECT batch_id, layers, digest, num_prompts FROM plan_batches "
                "ORDER BY missing NULLS FIRST, chunk"
            ).fetchall()
            faults.hit("plan.before-commit")
            con.commit()
        faults.hit("plan.committed")
        return [WorkBatch(bid, extraction_id, list(lay), digest, n) for bid, lay, digest, n in found]

    def pending_prompts(
        self, extraction_id: str, layers: list[int], rules_id: str, sources: list[str] | None = None
    ) -> int:
        """How many prompts `plan` would plan, without planning them."""
        with self._connect() as con:
            return one(con, f"WITH {TODO_CTES} SELECT count(*) FROM todo",
                        todo_params(rules_id, extraction_id, layers, sources))[0]

    def batch_prompts(self, batch_id: str) -> tuple[list[str], list[str]]:
        """(prompt hashes, normalised texts) of a planned batch, in plan order."""
        with self._connect() as con:
            found = con.execute(
                """SELECT p.prompt_hash, t.text FROM planned p JOIN prompts t ON p.prompt_hash = t.prompt_hash
                WHERE p.batch_id = ? ORDER BY p.ord""",
                [batch_id],
            ).fetchall()
        if not found:
            raise StoreError(f"unknown batch {batch_id}")
        return [h for h, _ in found], [t for _, t in found]
