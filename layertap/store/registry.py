"""Named datasets and the history of runs, kept in the store beside the data they describe.

A dataset is a name, the input files that belong to it and the extraction settings they get, so "embed
what is new in dataset X" needs nothing but the name: an event, a schedule or `layertap add` can ask for
it. The run history lets `layertap status` say what happened last without a Prefect server.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from layertap.errors import InputError, StoreError
from layertap.settings import EXTRACTION_OPTIONS, load_settings, settings_error_line
from layertap.store.inputs import check_inputs
from layertap.store.schema import DB_NAME, connect, one
from layertap.store.store_db import StoreDB

# Safe in a Prefect resource id, a file name and a shell without quoting.
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Dataset:
    name: str
    text_column: str
    options: dict
    sources: list[str]
    created_at: datetime


@dataclass(frozen=True)
class Added:
    """What `add_files` did: the files it was given (absolute), those new to the dataset, and whether it
    created the dataset."""

    dataset: Dataset
    created: bool
    files: list[str]
    new_files: list[str]


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise InputError(
            f"dataset name {name!r}: use 1-64 lowercase letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


class Registry:
    """Datasets and runs of one store. Opening it upgrades an older store (the tables are only added)."""

    def __init__(self, store_dir: str | Path, create: bool = True) -> None:
        root = Path(store_dir).expanduser().resolve()
        if not create and not (root / DB_NAME).is_file():
            raise StoreError(f"{root}: not a layertap store (no {DB_NAME})")
        self.db = StoreDB(root).prepare()  # a store of another version is refused here, not mid-command
        self.root = self.db.root

    def add_files(self, name: str, files: list[str], text_column: str, options: dict, given: set[str]) -> Added:
        """Register `files` under `name`, creating the dataset on first use. Their rows are read by the next
        run (the event-triggered one), which then reports them as new; the files are checked here
        (readable, has the text column) so a mistake fails at once.

        `options` are the resolved extraction settings; on an existing dataset, an option in `given` (set
        explicitly by the caller) must agree with what the dataset was created with, since changing it
        would silently start a second set of vectors.
        """
        check_name(name)
        options = {k: options.get(k) for k in EXTRACTION_OPTIONS}
        known = self.find(name)
        if known is not None:
            if text_column != known.text_column and "text_column" in given:
                raise InputError(f"dataset {name} reads column {known.text_column!r}, not {text_column!r}")
            text_column = known.text_column
            clashes = [k for k in EXTRACTION_OPTIONS if k in given and options[k] != known.options.get(k)]
            if clashes:
                listed = ", ".join(f"{k}={known.options.get(k)!r} (given {options[k]!r})" for k in clashes)
                raise InputError(f"dataset {name} was created with {listed}; use a new dataset name to change them")
        checked = check_inputs(list(files), text_column)
        new_files = [f for f in checked if known is None or f not in known.sources]
        with self.db._connect() as con:
            con.begin()
            if known is None:
                con.execute(
                    "INSERT INTO datasets VALUES (?, ?, ?, now())", [name, text_column, json.dumps(options)]
                )
            for source in new_files:
                con.execute(
                    """INSERT INTO dataset_sources SELECT ?, ?, now()
                    WHERE NOT EXISTS (SELECT 1 FROM dataset_sources WHERE dataset = ? AND source = ?)""",
                    [name, source, name, source],
                )
            con.commit()
        return Added(dataset=self.get(name), created=known is None, files=checked, new_files=new_files)

    def find(self, name: str) -> Dataset | None:
        with self.db._connect() as con:
            found = one(con, "SELECT name, text_column, options, created_at FROM datasets WHERE name = ?", [name])
            if found is None:
                return None
            sources = [
                row[0]
                for row in con.execute(
                    "SELECT source FROM dataset_sources WHERE dataset = ? ORDER BY added_at, source", [name]
                ).fetchall()
            ]
        return Dataset(found[0], found[1], json.loads(found[2]), sources, found[3])

    def get(self, name: str) -> Dataset:
        found = self.find(name)
        if found is None:
            names = self.names()
            known = f"known: {', '.join(names)}" if names else "none are registered (layertap add)"
            raise StoreError(f"{self.root}: no dataset {name!r} ({known})")
        return found

    def names(self) -> list[str]:
        with self.db._connect() as con:
            return [row[0] for row in con.execute("SELECT name FROM datasets ORDER BY name").fetchall()]

    def datasets(self) -> list[Dataset]:
        return [self.get(name) for name in self.names()]

    def start_run(self, dataset: str | None, flow_run_id: str | None) -> str:
        """Record a run as started, so one that dies still shows up in the history. Called by a run that holds
        the store's lock: a run still recorded as running lost that lock, so its process died (the kernel
        drops the lock with it), and it is marked crashed first."""
        run_id = uuid.uuid4().hex[:12]
        with self.db._connect() as con:
            con.execute(
                "UPDATE runs SET status = 'crashed', summary = ? WHERE status = 'running'",
                [json.dumps({"error": "its process died before the run ended (found by the next run)"})],
            )
            con.execute(
                "INSERT INTO runs VALUES (?, ?, ?, 'running', now(), NULL, '{}')", [run_id, dataset, flow_run_id]
            )
        return run_id

    def finish_run(self, run_id: str, status: str, seconds: float, summary: dict) -> None:
        with self.db._connect() as con:
            con.execute(
                "UPDATE runs SET status = ?, seconds = ?, summary = ? WHERE run_id = ?",
                [status, seconds, json.dumps(summary, default=str), run_id],
            )


# What a dataset fixes when it is created; a run can change everything else (batch size, engine options).
DATASET_FIXED = ("input", "store", "text_column", *EXTRACTION_OPTIONS)


def dataset_settings(dataset: str, store: str | None, env_file: str | None, options: dict | None = None):
    """The dataset's files and extraction settings on top of `options` and the environment."""
    from pydantic import ValidationError

    options = {k: v for k, v in (options or {}).items() if v is not None}
    fixed = sorted(set(options) & set(DATASET_FIXED))
    if fixed:
        raise InputError(f"{', '.join(fixed)}: fixed by dataset {dataset}, not a run option")
    try:
        base = load_settings(env_file=env_file, store=store, **options)
        found = Registry(base.store_path(), create=False).get(dataset)
        if not found.sources:
            raise InputError(f"dataset {dataset} has no files (layertap add --dataset {dataset} --input ...)")
        return load_settings(
            env_file=env_file, store=str(base.store_path()), input=found.sources, text_column=found.text_column,
            **options, **found.options,
        )
    except ValidationError as exc:
        raise InputError(settings_error_line(exc)) from None


def read_status(store_dir: str | Path, last_runs: int = 5) -> dict:
    """Datasets with their files and row counts, extractions with what they hold, and the latest runs.

    Read-only, so it works while a run holds the store for writing only after that run's short writes.
    """
    root = Path(store_dir).expanduser().resolve()
    db_path = root / DB_NAME
    if not db_path.is_file():
        raise StoreError(f"{root}: not a layertap store (no {DB_NAME})")
    with connect(db_path, read_only=True) as con:
        version = one(con, "SELECT value FROM meta WHERE key = 'schema_version'")[0]
        has_registry = version != "1"
        datasets = []
        if has_registry:
            for name, text_column, options, files, read, rows in con.execute(
                """SELECT d.name, d.text_column, d.options, count(ds.source), count(s.source),
                          coalesce(sum(s.num_rows), 0)
                FROM datasets d LEFT JOIN dataset_sources ds ON ds.dataset = d.name
                     LEFT JOIN sources s ON s.source = ds.source
                GROUP BY ALL ORDER BY d.name"""
            ).fetchall():
                datasets.append({"name": name, "text_column": text_column, "options": json.loads(options),
                                 "files": files, "files_read": read, "rows": int(rows)})
        rows, sources, prompts = one(
            con, "SELECT (SELECT count(*) FROM rows), (SELECT count(*) FROM sources), (SELECT count(*) FROM prompts)"
        )
        extractions = [
            {"extraction_id": eid, "model": model, "pooling": pooling, "dtype": dtype, "prompts": int(n or 0),
             "layers": list(layers or [])}
            for eid, model, pooling, dtype, n, layers in con.execute(
                """SELECT e.extraction_id, e.model_path, e.pooling, e.dtype,
                       (SELECT count(DISTINCT pp.prompt_hash) FROM part_prompts pp JOIN parts p USING (part_id)
                        WHERE p.extraction_id = e.extraction_id),
                       (SELECT list_sort(list_distinct(flatten(list(p.layers)))) FROM parts p
                        WHERE p.extraction_id = e.extraction_id)
                FROM extractions e ORDER BY e.created_at"""
            ).fetchall()
        ]
        runs = []
        if has_registry:
            for run_id, dataset, flow_run_id, status, started, seconds, summary in con.execute(
                "SELECT * FROM runs ORDER BY started_at DESC LIMIT ?", [last_runs]
            ).fetchall():
                runs.append({"run_id": run_id, "dataset": dataset, "flow_run_id": flow_run_id, "status": status,
                             "started_at": started, "seconds": seconds, "summary": json.loads(summary)})
    return {"store": str(root), "schema_version": version, "files": sources, "rows": rows, "prompts": prompts,
            "datasets": datasets, "extractions": extractions, "runs": runs}
