"""Check a whole store after the fact: every published part is where the manifest says, holds exactly its
prompts and layers, and its vectors pass the same checks a batch passes before publishing.

For stores that were copied, restored from a backup, or edited by hand; `layertap validate` runs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from layertap.parts import checks
from layertap.errors import StoreError, ValidationError
from layertap.store.publish import part_path
from layertap.store.schema import DB_NAME, connect


@dataclass
class StoreReport:
    store: str
    parts: int = 0
    vectors: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_store(store_dir: str | os.PathLike) -> StoreReport:
    root = Path(store_dir).expanduser().resolve()
    if not (root / DB_NAME).is_file():
        raise StoreError(f"{root}: not a layertap store (no {DB_NAME})")
    with connect(root / DB_NAME, read_only=True) as con:
        found = con.execute(
            """SELECT p.part_id, p.path, p.layers, e.hidden_size, list(pp.prompt_hash)
            FROM parts p JOIN extractions e USING (extraction_id) JOIN part_prompts pp USING (part_id)
            GROUP BY ALL ORDER BY p.part_id"""
        ).fetchall()
    report = StoreReport(store=str(root))
    for part_id, path, layers, hidden_size, hashes in found:
        report.parts += 1
        try:
            located = part_path(root, path)
        except StoreError as exc:
            report.problems.append(f"part {part_id}: {exc}")
            continue
        if not located.is_file():
            report.problems.append(f"part {part_id}: {path} is missing")
            continue
        try:
            checks.check_part(str(located), list(hashes), list(layers), hidden_size)
        except ValidationError as exc:
            report.problems.append(f"part {part_id}: {exc}")
            continue
        report.vectors += len(hashes) * len(layers)
    return report
