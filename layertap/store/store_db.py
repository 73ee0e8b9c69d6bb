"""`StoreDB`, the store's writer: the pipeline's tasks ingest, normalise, plan, publish and count through it.

Its operations live with their stage (`ingest`, `plan`, `publish`, `ledger`); this module opens the store
and creates, upgrades or refuses it on first use. `Store` (`reader`) is the read-only view users open.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb

from layertap.file_modes import drop_world_write, make_dirs
from layertap.store.ingest import Ingest
from layertap.store.ledger import Ledger
from layertap.store.plan import Planning
from layertap.store.publish import Publishing
from layertap.store.schema import DB_NAME, connect, create_or_upgrade


class StoreDB(Ingest, Planning, Publishing, Ledger):
    """Writer side of the store, used by the pipeline's tasks; each stage's operations come from its module."""

    def __init__(self, store_dir: str | os.PathLike) -> None:
        self.root = Path(store_dir).expanduser().resolve()
        self.db_path = self.root / DB_NAME
        for sub in ("parts", "staging"):
            make_dirs(self.root / sub)
        self._store_uuid: str | None = None

    def prepare(self) -> StoreDB:
        """Create, upgrade or refuse the store now rather than on its first use."""
        if self._store_uuid is None:
            self._connect().close()
        return self

    @property
    def store_uuid(self) -> str:
        """The id the store got when it was created (a recreated store gets another)."""
        return self.prepare()._store_uuid

    def _connect(self) -> duckdb.DuckDBPyConnection:
        """A connection to the store; the first one also creates, upgrades or refuses it. Done then rather
        than on construction: opening the database file costs tens of milliseconds, and a task's StoreDB
        usually serves one operation."""
        con = connect(self.db_path)
        if self._store_uuid is None:
            try:
                self._prepare(con)
            except BaseException:
                con.close()
                raise
        return con

    def _prepare(self, con: duckdb.DuckDBPyConnection) -> None:
        self._store_uuid = create_or_upgrade(con, self.db_path)
        drop_world_write(self.db_path)
