"""A real writer process for the concurrency tests: holds the store lock and keeps publishing parts.

Usage: python store_writer_child.py STORE ROUNDS [paced]. Each round appends 50 new rows, normalises, plans
and publishes every batch with deterministic stand-in vectors (no engine: the store is what is under test).
Prints "locked" once it holds the lock, then "round N" after each round; paced, it then waits for a line on
its stdin before the next round, so a reader sees every round however slowly it reads.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

from layertap.store.normalise import NormaliseRules
from layertap.store.extraction_key import ExtractionKey
from layertap.store.store_db import StoreDB
from layertap.store.lock import store_lock
from layertap.parts.writer import write_part

RULES = NormaliseRules()
KEY = ExtractionKey("fp-child", "/models/child", "last", "float32", RULES.rules_id, hidden_size=8, num_layers=2)


def vector(prompt_hash: str, layer: int) -> np.ndarray:
    seed = int(hashlib.sha256(f"{prompt_hash}:{layer}".encode()).hexdigest()[:8], 16)
    return np.random.default_rng(seed).standard_normal(8).astype(np.float32)


def main(store: str, rounds: int, paced: bool = False) -> None:
    with store_lock(store):
        print("locked", flush=True)
        db = StoreDB(store)
        eid = db.register_extraction(KEY)
        for r in range(rounds):
            source = Path(store).parent / f"input-{r}.csv"
            source.write_text("text\n" + "".join(f"round {r} row {i}\n" for i in range(50)))
            db.ingest([str(source)], "text")
            db.normalise(RULES)
            for batch in db.plan(eid, [0, 2], RULES.rules_id, 10):
                hashes, _ = db.batch_prompts(batch.batch_id)
                vectors = {layer: np.stack([vector(h, layer) for h in hashes]) for layer in batch.layers}
                relpath = write_part(db.root, eid, batch.batch_id, hashes, vectors, "float32")
                db.publish_part(eid, batch.batch_id, relpath, batch.layers, hashes)
            print(f"round {r}", flush=True)
            if paced and r + 1 < rounds:
                sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["paced"])
