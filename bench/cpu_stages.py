"""CPU stages benchmark: what the store costs on top of the same work written as plain DuckDB SQL.

Generates a 1M-row CSV (deterministic; ~30% of rows repeat an earlier prompt after normalisation, ~1% are
empty), then times, on this machine:
  (a) layertap: StoreDB ingest + normalise + plan on a fresh store;
  (b) the same steps as one raw DuckDB SQL script on a fresh database file (read_csv, the same normalise
      expression, sha256, distinct, anti-join against an empty results table);
  (c) a rerun of (a) with nothing new (ingest skips the file, normalise finds no rows, plan replans).
Targets: (a) <= 1.3 x (b), (c) <= 5 s (wall clock). With --repeat N each variant keeps its fastest run,
which filters out other processes on a shared machine. Prints a table and writes
bench/results/cpu_stages-<date>.json.

    .venv/bin/python bench/cpu_stages.py [--rows 1000000] [--repeat 1] [--no-save]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import duckdb

from layertap.store.normalise import NormaliseRules
from layertap.store.extraction_key import ExtractionKey
from layertap.store.store_db import StoreDB

RATIO_TARGET = 1.3
RERUN_TARGET_S = 5.0
LAYERS = list(range(33))
BATCH_SIZE = 1024

_SYLLABLES = ["ka", "lo", "mi", "re", "tu", "sa", "ne", "vo", "qi", "zu", "pe", "da", "fi", "gor", "lan", "tes",
              "st", "th", "an", "or"]
_ACCENTED = ["café", "naïve", "über", "ångström", "señor", "façade", "Zoë"]
_OTHER_SCRIPTS = ["東京", "Москва", "नमस्ते", "한국어", "Ελλάδα"]
_SEPARATORS = ["  ", "\t", " \u00a0", "\u3000", "\n", "\u2009"]


def generate_csv(path: Path, rows: int, seed: int = 1234) -> None:
    """Mostly-ASCII prompts of 4-20 words; repeats differ from their original only in ways normalisation
    removes (extra or unusual whitespace, NFD accents), so they dedup only after normalising."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(8000)]
    originals: list[str] = []
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["id", "text"])
        for i in range(rows):
            r = rng.random()
            if r < 0.01:
                text = rng.choice(["", "   ", "\t", " \u3000 "])
            elif r < 0.31 and originals:
                text = rng.choice(originals)
                variant = rng.random()
                if variant < 0.3:
                    text = text.replace(" ", rng.choice(_SEPARATORS), 1)
                elif variant < 0.6:
                    text = f"  {text} "
                elif variant < 0.7:
                    text = unicodedata.normalize("NFD", text)
            else:
                words = rng.choices(vocab, k=rng.randint(4, 20))
                kind = rng.random()
                if kind < 0.10:
                    words[rng.randrange(len(words))] = rng.choice(_ACCENTED)
                elif kind < 0.15:
                    words[rng.randrange(len(words))] = rng.choice(_OTHER_SCRIPTS)
                text = " ".join(words) + ("." if rng.random() < 0.2 else "")
                originals.append(text)
            out.writerow([i, text])


class Stages:
    """Wall and CPU seconds (all threads of this process, so DuckDB's workers count) per stage."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    @staticmethod
    def _now() -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), usage.ru_utime + usage.ru_stime

    @contextlib.contextmanager
    def stage(self, name: str):
        wall, cpu = self._now()
        yield
        end_wall, end_cpu = self._now()
        self.wall[name] = end_wall - wall
        self.cpu[name] = end_cpu - cpu

    def summary(self) -> dict[str, dict[str, float]]:
        self.wall["total"] = sum(self.wall.values())
        self.cpu["total"] = sum(self.cpu.values())
        return {
            "wall_s": {k: round(v, 3) for k, v in self.wall.items()},
            "cpu_s": {k: round(v, 3) for k, v in self.cpu.items()},
        }


def run_layertap(store_dir: Path, csv_path: Path) -> tuple[dict, int]:
    rules = NormaliseRules()
    key = ExtractionKey("bench-model", "/bench/model", "last", "float32", rules.rules_id, 4096, 32)
    stages = Stages()
    with stages.stage("ingest"):
        db = StoreDB(store_dir)
        db.ingest([str(csv_path)], "text")
    with stages.stage("normalise"):
        db.normalise(rules)
    with stages.stage("plan"):
        batches = db.plan(db.register_extraction(key), LAYERS, rules.rules_id, BATCH_SIZE)
    return stages.summary(), sum(b.num_prompts for b in batches)


def run_raw_sql(db_path: Path, csv_path: Path) -> tuple[dict, int]:
    """The pipeline's steps with no bookkeeping: each statement materialises its table, like the store."""
    expr = NormaliseRules().sql("raw_text")
    steps = {
        "ingest": """CREATE TABLE rows AS
            SELECT $path AS source, ordinality - 1 AS row_number, coalesce(text, '') AS raw_text
            FROM read_csv($path, header = true, all_varchar = true) WITH ORDINALITY""",
        "normalise": f"""CREATE TABLE row_prompts AS
            SELECT source, row_number, text, CASE WHEN text <> '' THEN sha256(text) END AS prompt_hash
            FROM (SELECT source, row_number, {expr} AS text FROM rows);
            CREATE TABLE prompts AS
            SELECT prompt_hash, any_value(text) AS text FROM row_prompts
            WHERE prompt_hash IS NOT NULL GROUP BY prompt_hash""",
        "plan": """CREATE TABLE results (prompt_hash VARCHAR, layer INTEGER);
            CREATE TABLE todo AS SELECT prompt_hash FROM prompts ANTI JOIN results USING (prompt_hash)""",
    }
    stages = Stages()
    con = duckdb.connect(str(db_path))
    for name, script in steps.items():
        with stages.stage(name):
            for statement in script.split(";"):
                con.execute(statement, {"path": str(csv_path)} if "$path" in statement else None)
            if name == "plan":  # closing checkpoints the file; the store's timings include that too
                planned = con.execute("SELECT count(*) FROM todo").fetchall()[0][0]
                con.close()
    return stages.summary(), planned


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model, "memory_gib": round(mem_kb / 2**20, 1)}


def save_results(name: str, report: dict) -> Path:
    """Write a benchmark's report to bench/results/<name>-<date>.json, to be committed with the code."""
    out = Path(__file__).resolve().parent / "results" / f"{name}-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("wrote", out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant; the fastest is kept")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="layertap-bench-") as tmp:
        work = Path(tmp)
        csv_path = work / "prompts.csv"
        generate_csv(csv_path, args.rows)
        runs: dict[str, list[dict]] = {"raw": [], "first": [], "rerun": []}
        for i in range(args.repeat):
            raw, raw_prompts = run_raw_sql(work / f"raw-{i}.duckdb", csv_path)
            first, prompts = run_layertap(work / f"store-{i}", csv_path)
            rerun, _ = run_layertap(work / f"store-{i}", csv_path)
            if prompts != raw_prompts:
                raise SystemExit(f"layertap planned {prompts} prompts, raw SQL {raw_prompts}")
            for name, timing in (("raw", raw), ("first", first), ("rerun", rerun)):
                runs[name].append(timing)
    raw, first, rerun = (min(runs[name], key=lambda t: t["wall_s"]["total"]) for name in ("raw", "first", "rerun"))
    ratio = first["wall_s"]["total"] / raw["wall_s"]["total"]
    cpu_ratio = first["cpu_s"]["total"] / raw["cpu_s"]["total"]
    print(f"{'stage':<10}{'(a) layertap':>22}{'(b) raw SQL':>22}{'(c) rerun':>22}   (wall / cpu seconds)")
    for stage in ("ingest", "normalise", "plan", "total"):
        cells = "".join(f"{r['wall_s'][stage]:>12.2f} /{r['cpu_s'][stage]:>7.2f}" for r in (first, raw, rerun))
        print(f"{stage:<10}{cells}")
    print(f"rows {args.rows}, prompts {prompts}; (a)/(b) wall {ratio:.2f}, cpu {cpu_ratio:.2f} "
          f"(target <= {RATIO_TARGET}); rerun {rerun['wall_s']['total']:.2f}s (target <= {RERUN_TARGET_S}s)")
    result = {
        "date": dt.date.today().isoformat(),
        "machine": {**machine(), "loadavg_1min_before": round(load_before, 2)},
        "duckdb": duckdb.__version__,
        "python": platform.python_version(),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "rows": args.rows,
        "repeat": args.repeat,
        "prompts": prompts,
        "layertap": first,
        "raw_sql": raw,
        "rerun": rerun,
        "ratio_wall": round(ratio, 3),
        "ratio_cpu": round(cpu_ratio, 3),
        "targets": {"ratio_max": RATIO_TARGET, "rerun_max_s": RERUN_TARGET_S},
        "met": ratio <= RATIO_TARGET and rerun["wall_s"]["total"] <= RERUN_TARGET_S,
    }
    if not args.no_save:
        save_results("cpu_stages", result)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
