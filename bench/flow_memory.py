"""Flow memory benchmark on the CPU: does the embed flow's resident memory grow with the length of a run?

Runs the `embed` flow on the embedded tiny model (real vLLM engine on the CPU) over the first N prompts of
the GPU benchmark's `short100k` workload, for each N given, and records the process's peak resident
memory (sampled every 50 ms) next to the run's time, after a warm-up run has started the engine. The
vectors are small here, so the figures show the flow's own per-run and per-batch memory (Prefect state,
plans, results, DuckDB), not host buffers; a peak that stays flat as N grows means a long run holds no
more than a short one.

    .venv/bin/python bench/flow_memory.py [--prompts 20000,100000] [--no-save]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stages import machine, save_results  # noqa: E402
from gpu_extract import RssSampler, _rss_gib, make_prompts  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="20000,100000", help="run lengths, comma-separated")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.csv as pacsv

    from flows.embed import embed_flow
    from layertap.runner import engine_cache
    from layertap.model.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="layertap-flow-memory-"))
    model = build_tiny_model(work / "model")
    prompts = make_prompts("short100k")
    runs = []
    common = dict(model=model, layers="all", pooling="last", parity_sample=0, batch_size=args.batch_size,
                  env_file=None)
    with engine_cache.pin():  # one engine for every run, as a worker keeps it
        warm = work / "warm.csv"
        pacsv.write_csv(pa.table({"text": prompts[:64]}), warm)
        embed_flow(input=[str(warm)], store=str(work / "store-warm"), **common)  # starts the engine
        for count in (int(n) for n in args.prompts.split(",")):
            data = work / f"prompts-{count}.csv"
            pacsv.write_csv(pa.table({"text": prompts[:count]}), data)
            before = _rss_gib()
            with RssSampler() as rss:
                start = time.perf_counter()
                summary = embed_flow(input=[str(data)], store=str(work / f"store-{count}"), **common)
                seconds = time.perf_counter() - start
            runs.append({"prompts": count, "embedded": summary["embedded"], "batches": summary["batches"],
                         "seconds": round(seconds, 1), "prompts_per_s": round(summary["embedded"] / seconds, 1),
                         "rss_before_gib": round(before, 2), "peak_rss_gib": round(rss.peak, 2)})
            print(json.dumps(runs[-1]), flush=True)
    report = {"date": dt.date.today().isoformat(), "machine": machine(), "command": "python " + " ".join(sys.argv),
              "model": "embedded tiny model (4 layers, hidden 128), float32, all 5 hidden states",
              "batch_size": args.batch_size, "runs": runs}
    if not args.no_save:
        save_results("flow_memory", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
