"""The ledger: every input row ends as exactly one of embedded | duplicate | rejected(reason), pending or
quarantined, and what is still to do for an extraction.

Both are single SQL statements over whole tables (`TODO_CTES`, `LEDGER_SQL`), shared by planning
(`plan`), the writer's counts (`Ledger`) and the reader (`Store.ledger`).
"""

from __future__ import annotations

import os

# Prompts that still lack a requested layer: `todo(prompt_hash, missing)`, where `missing` is the lacking
# layers as text ("3,7") or NULL for all of them, the common case, kept NULL so sorting by it stays cheap.
# Parts holding every requested layer settle their prompts with one anti-join; only prompts in narrower
# parts get per-layer bookkeeping. Parameters: $rules, $eid, $layers (sorted, distinct), $sources (the
# input files in scope, or NULL for every file in the store).
TODO_CTES = """
want AS (
    SELECT DISTINCT prompt_hash FROM row_prompts
    WHERE rules_id = $rules AND prompt_hash IS NOT NULL AND ($sources IS NULL OR list_contains($sources, source))),
refused AS (SELECT prompt_hash, reason FROM prompt_rejects WHERE extraction_id = $eid),
hits AS (
    SELECT part_id, list_has_all(layers, $layers) AS whole, list_intersect(layers, $layers) AS got
    FROM parts WHERE extraction_id = $eid AND list_has_any(layers, $layers)),
done AS (SELECT DISTINCT prompt_hash FROM part_prompts JOIN hits USING (part_id) WHERE whole),
partly AS (
    SELECT prompt_hash, flatten(list(got)) AS got
    FROM part_prompts JOIN hits USING (part_id) WHERE NOT whole GROUP BY prompt_hash),
todo AS (
    SELECT * FROM (
        SELECT w.prompt_hash,
               CASE WHEN p.got IS NOT NULL
                    THEN array_to_string(list_filter($layers, lambda l: NOT list_contains(p.got, l)), ',') END
               AS missing
        FROM want w ANTI JOIN done d ON w.prompt_hash = d.prompt_hash
             ANTI JOIN refused r ON w.prompt_hash = r.prompt_hash
             LEFT JOIN partly p ON w.prompt_hash = p.prompt_hash)
    WHERE missing IS NULL OR missing <> '')
"""

# One row per input row. The first row of a prompt (smallest (source, row_number)) carries its fate; later
# rows with the same prompt are duplicates. Rows of a prompt the engine refused are all rejected. A prompt
# still missing results whose batch was quarantined is `quarantined` (with the batch's error) until a rerun
# embeds it; an embedded prompt may carry a note (e.g. it was truncated to fit the model).
LEDGER_SQL = f"""
WITH {TODO_CTES},
held AS (
    SELECT pl.prompt_hash, any_value(q.error) AS error
    FROM quarantined q JOIN planned pl USING (batch_id) WHERE q.extraction_id = $eid GROUP BY pl.prompt_hash),
notes AS (SELECT prompt_hash, any_value(note) AS note FROM prompt_notes WHERE extraction_id = $eid GROUP BY ALL),
joined AS (
    SELECT r.source, r.row_number, rp.prompt_hash, rp.reject_reason, rp.source IS NULL AS unseen,
           row_number() OVER (PARTITION BY rp.prompt_hash ORDER BY r.source, r.row_number) AS k
    FROM rows r LEFT JOIN row_prompts rp
         ON rp.rules_id = $rules AND rp.source = r.source AND rp.row_number = r.row_number
    WHERE $sources IS NULL OR list_contains($sources, r.source))
SELECT j.source, j.row_number,
       CASE WHEN j.reject_reason IS NOT NULL OR x.reason IS NOT NULL THEN 'rejected'
            WHEN j.unseen THEN 'pending'
            WHEN j.k > 1 THEN 'duplicate'
            WHEN t.prompt_hash IS NOT NULL AND h.prompt_hash IS NOT NULL THEN 'quarantined'
            WHEN t.prompt_hash IS NOT NULL THEN 'pending'
            ELSE 'embedded' END AS status,
       CASE WHEN j.reject_reason IS NOT NULL OR x.reason IS NOT NULL THEN coalesce(j.reject_reason, x.reason)
            WHEN j.unseen OR j.k > 1 THEN NULL
            WHEN t.prompt_hash IS NOT NULL THEN h.error
            ELSE n.note END AS reason,
       j.prompt_hash
FROM joined j LEFT JOIN refused x ON j.prompt_hash = x.prompt_hash
     LEFT JOIN todo t ON j.prompt_hash = t.prompt_hash
     LEFT JOIN held h ON j.prompt_hash = h.prompt_hash
     LEFT JOIN notes n ON j.prompt_hash = n.prompt_hash
"""


def sorted_layers(layers: list[int]) -> list[int]:
    out = sorted({int(layer) for layer in layers})
    if not out:
        raise ValueError("at least one layer is needed")
    return out


def todo_params(rules_id: str, extraction_id: str, layers: list[int], sources: list[str] | None) -> dict:
    """The parameters of `TODO_CTES` (and `LEDGER_SQL`, which builds on it)."""
    return {"rules": rules_id, "eid": extraction_id, "layers": sorted_layers(layers), "sources": _scope(sources)}


def _scope(sources: list[str] | None) -> list[str] | None:
    """Input files a plan or ledger is limited to, as the store records them; None means all of them."""
    if sources is None:
        return None
    return [os.path.realpath(os.path.expanduser(str(s))) for s in sources]


class Ledger:
    """The ledger's counts, for `StoreDB` (the full ledger is `Store.ledger`)."""

    def ledger_counts(
        self, rules_id: str, extraction_id: str | None, layers: list[int], sources: list[str] | None = None
    ) -> dict:
        """Rows per status, plus rows per reason (rejections, quarantine errors, notes): {"rows", "embedded",
        "duplicate", "rejected", "pending", "quarantined", "reasons": {reason: n}}. The statuses add up to
        "rows". `sources` limits it to those input files."""
        params = todo_params(rules_id, extraction_id, layers, sources)
        with self._connect() as con:
            found = con.execute(
                f"SELECT status, reason, count(*) FROM ({LEDGER_SQL}) GROUP BY ALL", params
            ).fetchall()
        counts = {"rows": 0, "embedded": 0, "duplicate": 0, "rejected": 0, "pending": 0, "quarantined": 0,
                  "reasons": {}}
        for status, reason, n in found:
            counts["rows"] += n
            counts[status] += n
            if reason is not None and status == "rejected":
                counts["reasons"][reason] = counts["reasons"].get(reason, 0) + n
        return counts
