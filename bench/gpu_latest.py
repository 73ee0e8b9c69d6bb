"""The latest GPU figures in one file, and the README's performance table made from it.

    python bench/gpu_latest.py REPORT.json [REPORT.json ...] [--readme README.md]

REPORT files are what `bench/gpu_extract.py` writes (one per device call; their modes are merged, the
later file winning). `bench/results/gpu-latest.json` is rewritten with, per workload, each mode's
prompts/s, start-up seconds and memory, and the ratios to vLLM's plain generate; keys it holds that this
script does not make (`incremental_1000`, from `bench/incremental.py`) are kept. With --readme, the table
between the README's `gpu-latest` markers is made anew from the file.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LATEST = Path(__file__).parent / "results" / "gpu-latest.json"
WORKLOADS = {"short": "4,096 prompts, ~18 tokens", "medium": "2,000 prompts, ~240 tokens",
             "short100k": "100,000 prompts, ~18 tokens", "medium20k": "20,000 prompts, ~240 tokens"}
MODES = {"vllm_plain": "vLLM plain generate", "layertap_runner": "layertap runner", "layertap": "flow",
         "layertap_float16": "flow, float16 stored"}
RUN_KEYS = ("date", "gpu", "machine", "vllm", "torch", "commit", "model", "layers", "pooling", "batch_size",
            "batches_in_flight", "passes_per_vllm_mode", "cold_modes")
START = "<!-- gpu-latest:start (made by bench/gpu_latest.py) -->"
END = "<!-- gpu-latest:end -->"


def _mode_entry(result: dict) -> dict:
    """What the latest file keeps of one mode's run on one workload."""
    tree = result.get("peak_pss_of_process_tree_during_run_gib") or {}
    return {
        "status": result.get("status"),
        "prompts_per_s": result.get("prompts_per_s"),
        "seconds": result.get("seconds"),
        "start_s": result.get("startup_s", result.get("startup_and_warmup_s")),
        "peak_tree_pss_gib": tree.get("total"),
        "capture_buffer_bytes": result.get("capture_buffer_bytes"),
        "store_bytes": result.get("store_bytes"),
        "parity_sample": result.get("parity_sample"),
        "gpu_memory_utilization": result.get("gpu_memory_utilization"),
        "error": result.get("error"),
    }


def merge(reports: list[dict], previous: dict) -> dict:
    """One latest file from the reports of one machine's calls, keeping `previous`'s other keys."""
    latest = {k: v for k, v in previous.items() if k.startswith("incremental_")}
    latest.update({k: reports[-1].get(k) for k in RUN_KEYS})
    latest["commands"] = [r.get("command") for r in reports]
    workloads: dict[str, dict] = {}
    for report in reports:
        for workload in WORKLOADS:
            for mode, result in (report.get(workload) or {}).get("modes", {}).items():
                entry = _mode_entry(result)
                entry["start"] = result.get("compile_cache") or (
                    "cold" if mode in (report.get("cold_modes") or "").split(",") else "warm")
                workloads.setdefault(workload, {})[mode] = entry
    for modes in workloads.values():
        plain = (modes.get("vllm_plain") or {}).get("prompts_per_s")
        for mode, entry in modes.items():
            if mode != "vllm_plain" and plain and entry["prompts_per_s"]:
                entry["ratio_vs_vllm_plain"] = round(entry["prompts_per_s"] / plain, 3)
    latest["workloads"] = workloads
    return latest


def table(latest: dict) -> str:
    """The README's table: prompts/s (ratio to plain generate) per workload, then start-up and memory."""
    workloads = latest.get("workloads", {})
    modes = [m for m in MODES if any(m in w for w in workloads.values())]
    lines = ["| " + " | ".join(["workload", *(MODES[m] for m in modes)]) + " |",
             "|" + " --- |" * (len(modes) + 1)]

    def cell(entry: dict | None, key: str, fmt: str) -> str:
        if not entry or entry.get(key) is None:
            return "—" if not entry or entry.get("status") == "ok" else f"({entry.get('status')})"
        text = format(entry[key], fmt)
        ratio = entry.get("ratio_vs_vllm_plain") if key == "prompts_per_s" else None
        return f"{text} ({ratio:.2f}x)" if ratio else text

    for workload, label in WORKLOADS.items():
        if workload in workloads:
            row = [f"{workload}: {label}", *(cell(workloads[workload].get(m), "prompts_per_s", ",.0f") for m in modes)]
            lines.append("| " + " | ".join(row) + " |")
    firsts = {m: next((w[m] for w in workloads.values() if w.get(m, {}).get("start_s")), None) for m in modes}
    start = [f"{firsts[m]['start_s']:.0f} s ({firsts[m]['start']})" if firsts[m] else "—" for m in modes]
    lines.append("| " + " | ".join(["start-up (compile cache)", *start]) + " |")
    big = workloads.get("short100k", {})
    memory = [f"{big[m]['peak_tree_pss_gib']:.2f} GiB" if big.get(m, {}).get("peak_tree_pss_gib") else "—"
              for m in modes]
    lines.append("| " + " | ".join(["peak memory, process tree (PSS), short100k", *memory]) + " |")
    model = latest.get("model") or {}
    commit = (latest.get("commit") or "")[:7]
    lines.append("")
    host = latest.get("machine") or {}
    cpu = f" ({host['nproc']} cores of {host['cpu_model']})" if host.get("cpu_model") else ""
    lines.append(f"{latest.get('gpu')}{cpu}, vLLM {latest.get('vllm')}, {latest.get('date')}, commit {commit}: "
                 f"{model.get('shape', model.get('dir'))} in {model.get('dtype')} with {model.get('weights')}, "
                 f"{latest.get('layers')}, {latest.get('pooling')} token, batches of {latest.get('batch_size')}, "
                 f"{latest.get('batches_in_flight')} in flight; prompts/s with the ratio to plain generate. The "
                 "flow is the `embed` flow from input file to published, validated store, Prefect included"
                 + (f", with the parity sample ({_parity(workloads)} prompts)" if _parity(workloads) else "") + ".")
    return "\n".join(lines)


def _parity(workloads: dict) -> int | None:
    return next((m["parity_sample"] for w in workloads.values() for name, m in w.items()
                 if name == "layertap" and m.get("parity_sample")), None)


def write_readme(readme: Path, latest: dict) -> None:
    text = readme.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {START} ... {END} section")
    readme.write_text(pattern.sub(lambda _: f"{START}\n{table(latest)}\n{END}", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="*", type=Path)
    parser.add_argument("--latest", type=Path, default=LATEST)
    parser.add_argument("--readme", type=Path)
    args = parser.parse_args()
    previous = json.loads(args.latest.read_text()) if args.latest.is_file() else {}
    latest = merge([json.loads(p.read_text()) for p in args.reports], previous) if args.reports else previous
    args.latest.write_text(json.dumps(latest, indent=1) + "\n")
    if args.readme:
        write_readme(args.readme, latest)
    print(table(latest))


if __name__ == "__main__":
    main()
