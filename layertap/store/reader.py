"""`Store`, the read-only view users open: embeddings per layer, SQL over the published results, the
ledger, and what has been extracted. It sees only what was published.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from layertap.errors import StoreError
from layertap.parts.sorted_layer import read_layer_sorted
from layertap.parts.writer import layer_column
from layertap.store.ledger import LEDGER_SQL, sorted_layers, todo_params
from layertap.store.publish import part_path
from layertap.store.schema import DB_NAME, UPGRADABLE_VERSIONS, check_version, connect, one, quote_ident, quote_literal


class Store:
    """Read-only view of a store: embeddings per layer, the ledger, and what has been extracted.

    Keyword filters (model = path or fingerprint, pooling, dtype, rules_id, store_dtype) pick one extraction
    when the store holds several.
    """

    def __init__(self, store_dir: str | os.PathLike) -> None:
        self.root = Path(store_dir).expanduser().resolve()
        self.db_path = self.root / DB_NAME
        if not self.db_path.is_file():
            raise StoreError(f"{self.root}: not a layertap store (no {DB_NAME})")
        with self._connect() as con:
            self.schema_version = check_version(con, self.db_path, readable=UPGRADABLE_VERSIONS)
            self.store_uuid = one(con, "SELECT value FROM meta WHERE key = 'store_uuid'")[0]

    def _connect(self) -> duckdb.DuckDBPyConnection:
        return connect(self.db_path, read_only=True)

    def extractions(self) -> pa.Table:
        """One row per extraction key, with the layers that have published results."""
        with self._connect() as con:
            return con.sql(
                """SELECT e.extraction_id, e.model_path, e.model_fingerprint, e.pooling, e.dtype, e.stored_dtype,
                       e.rules_id, e.hidden_size, e.num_layers,
                       list_sort(list_distinct(flatten(list(p.layers) FILTER (p.layers IS NOT NULL)))) AS layers,
                       e.created_at
                FROM extractions e LEFT JOIN parts p USING (extraction_id)
                GROUP BY ALL ORDER BY e.created_at, e.extraction_id"""
            ).to_arrow_table()

    def _pick(
        self, con: duckdb.DuckDBPyConnection, model: str | None, pooling: str | None, dtype: str | None,
        rules_id: str | None, store_dtype: str | None = None,
    ) -> tuple[str, int, str, list[int]]:
        """(extraction_id, num_layers, rules_id, layers with results) of the one matching extraction."""
        found = con.execute(
            """SELECT e.extraction_id, e.num_layers, e.rules_id,
                      list_sort(list_distinct(flatten(list(p.layers) FILTER (p.layers IS NOT NULL)))),
                      e.model_path, e.pooling, e.dtype, e.stored_dtype
            FROM extractions e LEFT JOIN parts p USING (extraction_id)
            WHERE ($model IS NULL OR e.model_fingerprint = $model OR e.model_path IN ($model, $model_abs))
              AND ($pooling IS NULL OR e.pooling = $pooling) AND ($dtype IS NULL OR e.dtype = $dtype)
              AND ($rules IS NULL OR e.rules_id = $rules) AND ($stored IS NULL OR e.stored_dtype = $stored)
            GROUP BY ALL""",
            {"model": model, "model_abs": os.path.abspath(model) if model else None,
             "pooling": pooling, "dtype": dtype, "rules": rules_id, "stored": store_dtype},
        ).fetchall()
        if not found:
            raise StoreError(f"{self.root}: no extraction matches")
        if len(found) > 1:
            listed = "; ".join(f"model={m} pooling={p} dtype={d} store_dtype={sd} rules_id={r}"
                               for _, _, r, _, m, p, d, sd in found)
            raise StoreError(
                f"{self.root}: several extractions match ({listed}); pass model/pooling/dtype/store_dtype/rules_id")
        eid, num_layers, rules_id, layers = found[0][:4]
        return eid, num_layers, rules_id, list(layers or [])

    def layers(
        self, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> list[int]:
        """Layers with at least one published result."""
        with self._connect() as con:
            return self._pick(con, model, pooling, dtype, rules_id, store_dtype)[3]

    def resolve_layer(
        self, layer: int, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> int:
        """The 0..N index of `layer` (negative counts from the end) in the chosen extraction's model."""
        with self._connect() as con:
            num_layers = self._pick(con, model, pooling, dtype, rules_id, store_dtype)[1]
        return layer + num_layers + 1 if layer < 0 else layer

    def embeddings(
        self, layer: int, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> pa.Table:
        """prompt_hash, text, embedding for one layer (negative counts from the end), sorted by prompt_hash.

        Reads only the prompt_hash and layer_{L} column chunks of each part, never other layers' bytes. The
        database is not held open while the vectors are read, so a long read never keeps a run from
        publishing (published parts are never changed, so what was listed stays readable).
        """
        with self._connect() as con:
            eid, num_layers, _, _ = self._pick(con, model, pooling, dtype, rules_id, store_dtype)
            layer = layer + num_layers + 1 if layer < 0 else layer
            found = con.execute(
                "SELECT path FROM parts WHERE extraction_id = ? AND list_contains(layers, ?) ORDER BY part_id",
                [eid, layer],
            ).fetchall()
        paths = [part_path(self.root, row[0]) for row in found]
        if not paths:
            raise StoreError(f"{self.root}: layer {layer} has no results for extraction {eid}")
        hashes, embedding = read_layer_sorted([str(path) for path in paths], layer_column(layer))
        with self._connect() as con:
            con.register("wanted", pa.table({"prompt_hash": hashes}))
            texts = con.sql("SELECT prompt_hash, text FROM prompts SEMI JOIN wanted USING (prompt_hash)")
            texts = texts.to_arrow_table()
        text = texts["text"].take(pc.index_in(hashes, value_set=texts["prompt_hash"]))
        return pa.table({"prompt_hash": hashes, "text": text, "embedding": embedding})

    def sql(
        self, query: str, *, model: str | None = None, pooling: str | None = None, dtype: str | None = None,
        rules_id: str | None = None, store_dtype: str | None = None,
    ) -> pa.Table:
        """Run DuckDB SQL over the published results of one extraction, e.g.
        `Store(path).sql("SELECT prompt_hash, layer_4 FROM vectors")`.

        Two views: `vectors` (prompt_hash, then a `layer_<L>` column per layer with results: one row per
        prompt, NULL where that prompt lacks the layer) over the published Parquet files only, never files a
        run has written but not published; and `prompts` (prompt_hash, text) of those prompts. The query runs
        in a connection of its own, after the store's database is closed again.
        """
        with self._connect() as con:
            eid, _, _, layers = self._pick(con, model, pooling, dtype, rules_id, store_dtype)
            paths = [str(part_path(self.root, row[0])) for row in con.execute(
                "SELECT path FROM parts WHERE extraction_id = ? ORDER BY part_id", [eid]).fetchall()]
            texts = con.sql("""SELECT t.prompt_hash, t.text FROM prompts t
                               WHERE t.prompt_hash IN (SELECT pp.prompt_hash FROM part_prompts pp
                                                       JOIN parts p USING (part_id) WHERE p.extraction_id = $eid)""",
                            params={"eid": eid}).to_arrow_table()
        if not paths:
            raise StoreError(f"{self.root}: extraction {eid} has no published results")
        with duckdb.connect() as con:
            con.execute("SET enable_progress_bar = false")
            columns = ", ".join(f"any_value({name}) AS {name}" for name in map(quote_ident, map(layer_column, layers)))
            files = ", ".join(quote_literal(path) for path in paths)  # a view takes no parameters
            con.execute(f"""CREATE VIEW vectors AS
                            SELECT prompt_hash, {columns} FROM read_parquet([{files}], union_by_name = true)
                            GROUP BY prompt_hash""")
            con.register("prompts", texts)
            return con.sql(query).to_arrow_table()

    def ledger(
        self, layers: list[int] | None = None, *, model: str | None = None, pooling: str | None = None,
        dtype: str | None = None, rules_id: str | None = None, store_dtype: str | None = None,
    ) -> pa.Table:
        """One row per input row: source, row_number, status (embedded|duplicate|rejected|pending), reason,
        prompt_hash. `layers` defaults to every layer with results (every layer if none has any yet)."""
        with self._connect() as con:
            eid, num_layers, rules_id, published = self._pick(con, model, pooling, dtype, rules_id, store_dtype)
            layers = sorted_layers(layers or published or range(num_layers + 1))
            return con.sql(
                f"{LEDGER_SQL} ORDER BY j.source, j.row_number",
                params=todo_params(rules_id, eid, layers, None),
            ).to_arrow_table()
