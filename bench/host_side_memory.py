"""Host-side memory of the embed flow with a 7B model's vectors, on a CPU: does it grow with the run?

On the H200 the flow's anonymous memory grew steadily through a 100,000-prompt run (about 18 MB/s), while
`flow_memory.py` (the real engine on the tiny model, whose vectors are tiny) stays flat. This benchmark
runs everything the flow does on the host (Prefect tasks, DuckDB, the value checks, the Parquet writer,
host buffers) on vectors of the GPU's size and dtype (33 layers x 4096, bfloat16 by default), with the
engine replaced by a stand-in that hands over host buffers filled once with random values, so only the
host side runs. It records resident memory and its parts every 5 s, then glibc's own account (`mallinfo2`)
and what `malloc_trim` gives back, and Python's allocations over the run (tracemalloc, with --trace).

    .venv/bin/python bench/host_side_memory.py [--prompts 30000] [--dtype bfloat16] [--trace] [--no-save]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import gc
import json
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_stages import machine, save_results  # noqa: E402
from gpu_extract import LLAMA2_7B, PhaseTimes, RssSampler, _memory_gib, make_prompts  # noqa: E402
from task_overhead import Spinners  # noqa: E402


class StandInRunner:
    """The engine's interface on the host side only: `extract` returns a host buffer's vectors as the
    real runner does (same pool, same views), filled with random values the first time each buffer is used."""

    def __init__(self, num_layers: int, hidden_size: int, dtype: str):
        import torch

        from layertap.runner.host_buffers import HostBuffers

        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.dtype = getattr(torch, dtype)
        self.pool = HostBuffers()
        self.filled: set[str] = set()

    def reserve_host_buffers(self, prompts: int, layers: int, count: int, pooling: str = "last") -> None:
        self.pool.reserve((layers, prompts, self.hidden_size), count, self.dtype)

    def extract(self, texts, layers, pooling, **options):
        import torch

        from layertap.runner.base import Extraction
        from layertap.runner.vllm_runner import _as_numpy

        vectors, segment = self.pool.take((len(layers), len(texts), self.hidden_size), self.dtype)
        if segment.path not in self.filled:
            whole = segment.tensor[: segment.nbytes() // self.dtype.itemsize * self.dtype.itemsize].view(self.dtype)
            for chunk in whole.split(1 << 20):  # a MiB of values at a time: the fill's own temporaries stay
                chunk.copy_(torch.randn(chunk.shape))  # small beside the flow's memory being measured
            self.filled.add(segment.path)
        stacked = _as_numpy(vectors)
        return Extraction({layer: stacked[j] for j, layer in enumerate(layers)}, list(range(len(texts))),
                          num_tokens=18 * len(texts), release_fn=lambda: self.pool.give_back(segment))

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self.pool.clear()


def _glibc() -> dict:
    """glibc malloc's heap in use and free (MB), and the resident memory `malloc_trim(0)` gives back."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    before = _memory_gib()["anon"]
    libc.malloc_trim(0)
    return {"heap_mb": round(info.arena / 2**20, 1), "in_use_mb": round(info.uordblks / 2**20, 1),
            "free_mb": round(info.fordblks / 2**20, 1), "mmapped_mb": round(info.hblkhd / 2**20, 1),
            "trim_released_gib": round(before - _memory_gib()["anon"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=30000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--trace", action="store_true", help="also trace Python allocations (slower)")
    parser.add_argument("--busy", type=int, default=None,
                        help="threads computing in Python beside the flow, as vLLM's engine loop does in-process "
                             "(the report is saved as host_side_memory-busy<N>-<date>.json)")
    parser.add_argument("--encoders", type=int, default=None,
                        help="Parquet encoder threads (default: one per core), e.g. a GPU host's 16 on a smaller CPU")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write bench/results/")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.csv as pacsv

    from flows.embed import embed_flow
    from layertap.runner import engine_cache
    from layertap.model.tiny_model import build_tiny_model
    from layertap.parts import writer

    if args.encoders:
        writer.limit_encoder_threads(args.encoders)

    work = Path(tempfile.mkdtemp(prefix="layertap-host-side-"))
    # The stand-in never runs the model: a tiny one whose config claims the 7B shape fixes layers and width.
    model = work / "model"
    shutil.copytree(build_tiny_model(work / "tiny"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=LLAMA2_7B["hidden_size"], num_hidden_layers=LLAMA2_7B["num_hidden_layers"])
    (model / "config.json").write_text(json.dumps(config))
    runner = StandInRunner(LLAMA2_7B["num_hidden_layers"], LLAMA2_7B["hidden_size"], args.dtype)
    engine_cache._start = lambda settings: runner  # the engine boundary: every start gets the stand-in

    prompts = make_prompts("short100k")[: args.prompts]
    data, warm = work / "prompts.csv", work / "warm.csv"
    pacsv.write_csv(pa.table({"text": prompts}), data)
    pacsv.write_csv(pa.table({"text": prompts[:64]}), warm)
    common = dict(model=str(model), layers="all", pooling="last", dtype=args.dtype, parity_sample=0,
                  batch_size=1024, env_file=None)
    with engine_cache.pin():
        embed_flow(input=[str(warm)], store=str(work / "store-warm"), **common)
        if args.trace:
            gc.collect()
            tracemalloc.start(10)
            traced = tracemalloc.take_snapshot()
        before = _memory_gib()
        with RssSampler(every=5.0) as rss, PhaseTimes() as phases, Spinners(args.busy or 0):
            start = time.perf_counter()
            summary = embed_flow(input=[str(data)], store=str(work / "store"), **common)
            seconds = time.perf_counter() - start
        after = _memory_gib()
        python_growth = None
        if args.trace:
            gc.collect()
            stats = tracemalloc.take_snapshot().compare_to(traced, "traceback")
            python_growth = {"total_mb": round(sum(s.size_diff for s in stats) / 2**20, 2),
                             "largest": [{"mb": round(s.size_diff / 2**20, 3), "blocks": s.count_diff,
                                          "at": s.traceback.format()[-2:]} for s in stats[:5]]}
            tracemalloc.stop()
    report = {"date": dt.date.today().isoformat(), "machine": machine(), "command": "python " + " ".join(sys.argv),
              "vectors": f"{LLAMA2_7B['num_hidden_layers'] + 1} layers x {LLAMA2_7B['hidden_size']} {args.dtype}",
              "prompts": args.prompts, "busy_threads": args.busy or 0, "encoder_threads": writer.encoder_threads(),
              "embedded": summary["embedded"],
              "batches": summary["batches"],
              "seconds": round(seconds, 1), "memory_before_gib": before, "memory_after_gib": after,
              "anon_growth_mb_per_batch": round((after["anon"] - before["anon"]) * 1024 / summary["batches"], 2),
              "task_phase_seconds_summed_over_batches": phases.seconds,
              "flow_step_seconds_on_flow_thread": phases.flow_steps,
              "peak_rss_gib": rss.peak, "memory_at_peak_gib": rss.at_peak, "timeline_gib": rss.timeline,
              "glibc_after": _glibc(),
              "python_allocations_over_the_run": python_growth}
    print(json.dumps({k: v for k, v in report.items() if k != "timeline_gib"}, indent=1))
    if not args.no_save:
        save_results("host_side_memory" + ("" if args.busy is None else f"-busy{args.busy}"), report)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
