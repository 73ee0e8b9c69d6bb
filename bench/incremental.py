"""Small incremental runs through the triggered path: cold, warm and no-op, each of 1,000 new rows.

Everything is real and in processes of its own, as a user sets it up: `prefect server start` on 127.0.0.1
(its own PREFECT_HOME and port), `layertap serve` serving the three deployments of prefect.yaml, and
`layertap add`, whose rows-added event triggers `embed-new-rows` for the dataset. Each run is timed from
just before `layertap add` starts until the triggered run has recorded itself as completed in the store.

    .venv/bin/python bench/incremental.py --out bench/results                 # CPU: the tiny model
    python3 bench/incremental.py --out bench/results --gpu-model \\
        --gpu-latest bench/results/gpu-latest.json                            # GPU: 7B shape, dummy weights

Sequence (one store, one engine directory, both fresh temp dirs):
  0. the dataset gets 1,000 rows and its triggered run embeds them (it starts a warm engine, which is then
     stopped: the next run must find none);
  1. cold: a new file of --rows rows; the triggered run starts the engine;
  2. warm: another new file; the triggered run attaches to the engine the cold run left up (checked: no line
     is added to the engine directory's engine-starts.log);
  3. noop: a fresh `layertap run --dataset` process that finds nothing new (wall clock of the process).

When a run is done is read from the flow run's "embed done" log line, which the flow logs right after it
records the run as completed in the store; the bench polls the Prefect API, not the store, because a
reader of the store's DuckDB file holds a lock the flow's own opens would wait on.
`layertap add` is timed apart (process start, registering the file, the event); `event_to_published_s`
counts from its return, `add_to_published_s` (the headline cold_s / warm_s) from its start.

Each run's `phases` split the time after the event with the server's own records: the automation firing
(`prefect.automation.triggered`), the flow run's creation by the trigger's run-deployment action, its
Pending state (the runner picked it up: `serve`'s poll), its Running state (the run's process has started,
imported Prefect and the flow, and entered the flow) and "embed done". `create_retries` counts the flow-run
creations the server answered as busy (SQLite "database is locked"; the server logs them with
PREFECT_API_LOG_RETRYABLE_ERRORS), each of which its client retries after about 2 s.
--warm-repeats N measures N warm runs (each of --rows new rows) and reports their median beside the first.

CPU default: the tiny model (layertap.model.tiny_model), float32, parity sample 8: the settings of `make demo`.
--gpu-model: a Llama-2-7B-shaped folder (bench/gpu_extract.build_model_dir), LAYERTAP_LOAD_FORMAT=dummy,
LAYERTAP_PARITY_SAMPLE=0, bfloat16, all layers. The cold run's engine start reuses whatever vLLM and torch
cached on disk during the preparation run (compiled graphs), as a restarted engine does.
Writes DIR/incremental-<date>-<machine>.json; --gpu-latest PATH also sets that JSON file's
`incremental_<rows>` key.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATASET = "bench"
DEPLOYMENTS = {"embed", "embed-new-rows", "embed-nightly"}
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
DONE_MARK = "embed done:"  # flows/pipeline.py logs it right after recording the run as completed


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompts(start: int, count: int) -> list[str]:
    """Unique short sentences, 17 bytes each: 18 tokens with BOS for the byte-level tokenizers."""
    return [f"Row {i:06d} is new" for i in range(start, start + count)]


def write_csv(path: Path, texts: list[str]) -> str:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        writer.writerows([t] for t in texts)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_time(text: str | None) -> float | None:
    """Seconds since the epoch of one of Prefect's ISO timestamps."""
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def since(t: float | None, origin: float) -> float | None:
    return None if t is None else round(t - origin, 3)


class Failed(RuntimeError):
    pass


class Setup:
    """The Prefect server, `layertap serve`, and the commands run against them, with their logs."""

    def __init__(self, work: Path, extra_env: dict[str, str]) -> None:
        self.work = work
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.store = work / "store"
        self.engine_dir = work / "engines"
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("LAYERTAP_", "PREFECT_"))}
        self.env.update(
            PREFECT_HOME=str(work / "prefect-home"),
            PREFECT_API_URL=self.api,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_SERVER_UI_ENABLED="false",
            PREFECT_CLI_PROMPT="false",
            PREFECT_API_LOG_RETRYABLE_ERRORS="true",  # busy answers are counted from the server's log
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            VLLM_LOGGING_LEVEL="WARNING",
            LAYERTAP_ENGINE_DIR=str(self.engine_dir),
            LAYERTAP_STORE=str(self.store),
            **extra_env,
        )
        self.server: subprocess.Popen | None = None
        self.serve: subprocess.Popen | None = None
        self.http = httpx.Client(base_url=self.api, timeout=30)

    # --- processes ---------------------------------------------------------------------------------
    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = (self.logs / f"{name}.log").open("w")
        return subprocess.Popen(args, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def run(self, name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        out = subprocess.run(args, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        (self.logs / f"{name}.log").write_text(
            f"$ {' '.join(args)}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}")
        if out.returncode != 0:
            raise Failed(f"{' '.join(args)} exited with {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
                         for p in sorted(self.logs.glob("*.log")))

    def check_alive(self) -> None:
        for name, proc in (("prefect server", self.server), ("layertap serve", self.serve)):
            if proc is not None and proc.poll() is not None:
                raise Failed(f"{name} exited with {proc.returncode}")

    def start_server(self, timeout: float = 300) -> None:
        self.server = self.start("server", sys.executable, "-m", "prefect", "server", "start",
                                 "--host", "127.0.0.1", "--port", str(self.port))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise Failed(f"prefect server not healthy within {timeout:.0f} s")

    def start_serve(self, timeout: float = 300) -> None:
        self.serve = self.start("serve", sys.executable, "-m", "flows.cli", "serve")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                names = {d["name"] for d in self.post("/deployments/filter", {})}
                triggers = [a for a in self.post("/automations/filter", {})
                            if "layertap.dataset.rows-added" in (a.get("trigger") or {}).get("expect", [])]
                if DEPLOYMENTS <= names and triggers:
                    return
            time.sleep(0.5)
        raise Failed(f"layertap serve did not register its deployments within {timeout:.0f} s")

    def post(self, path: str, body: dict) -> list:
        response = self.http.post(path, json=body)
        response.raise_for_status()
        return response.json()

    def teardown(self) -> None:
        if self.serve is not None and self.serve.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.serve.pid, signal.SIGTERM)
            try:
                self.serve.wait(timeout=90)  # serve stops the engines of its engine dir on its way out
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.serve.pid, signal.SIGKILL)
                self.serve.wait()
        with contextlib.suppress(Exception):
            from layertap.runner import warm_engine

            if self.engine_dir.is_dir():
                warm_engine.stop_engines(self.engine_dir)
        if self.server is not None and self.server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        self.http.close()

    # --- the measured steps ------------------------------------------------------------------------
    def engine_starts(self) -> list[dict]:
        path = self.engine_dir / "engine-starts.log"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def flow_runs(self) -> list[dict]:
        return self.post("/flow_runs/filter", {"deployments": {"name": {"any_": ["embed-new-rows"]}}})

    def done_log_time(self, flow_run_id: str, timeout: float = 30) -> float | None:
        """When the flow logged that it had recorded the run as completed (its logs may arrive late)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                              "sort": "TIMESTAMP_DESC", "limit": 200})
            for entry in logs:
                if DONE_MARK in entry.get("message", ""):
                    return parse_time(entry["timestamp"])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.5)

    def event_occurred(self, event_id: str, timeout: float = 30) -> float | None:
        """When the server says the event occurred (its own timestamp), once it has stored it."""
        body = {"filter": {"id": {"id": [event_id]}, "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 1}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                found = self.http.post("/events/filter", json=body).json()["events"]
                if found:
                    return parse_time(found[0]["occurred"])
            time.sleep(0.5)
        return None

    def create_retries(self) -> int:
        """How many flow-run creations the server has answered as busy so far."""
        path = self.logs / "server.log"
        return path.read_text(errors="replace").count("[SQL: INSERT INTO flow_run (") if path.is_file() else 0

    def phases(self, event_id: str, occurred: float | None, flow_run_id: str, published: float) -> dict:
        """Seconds from the event's own timestamp to each step the server recorded for its run."""
        if occurred is None:
            return {}
        body = {"filter": {"event": {"name": ["prefect.automation.triggered"]},
                           "related": {"id": [f"prefect.event.{event_id}"]},
                           "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 5}
        triggered = None
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            found = self.http.post("/events/filter", json=body).json()["events"]
            triggered = min((parse_time(e["occurred"]) for e in found), default=None)
        states = {}
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            for state in self.http.get("/flow_run_states/", params={"flow_run_id": flow_run_id}).json():
                states.setdefault(state["type"], parse_time(state["timestamp"]))
        marks = [("automation_triggered", triggered), ("created", states.get("SCHEDULED")),
                 ("pending", states.get("PENDING")), ("running", states.get("RUNNING")), ("published", published)]
        out = {f"event_to_{name}_s": since(t, occurred) for name, t in marks}
        steps = [(name, t) for name, t in marks if t is not None]
        for (a, ta), (b, tb) in zip(steps, steps[1:]):
            out[f"{a}_to_{b}_s"] = round(tb - ta, 3)
        return out

    def triggered_run(self, name: str, csv_path: str, first_add_args: list[str], timeout: float) -> dict:
        """`layertap add` one file, then wait for the flow run its event triggers; the run's timings."""
        known = {r["id"] for r in self.flow_runs()}
        retries_before = self.create_retries()
        starts_before = len(self.engine_starts())
        cmd = [sys.executable, "-m", "flows.cli", "add", "--dataset", DATASET, "--input", csv_path,
               "--store", str(self.store), "--json", *first_add_args]
        t0 = time.time()
        added = json.loads(self.run(f"add-{name}", *cmd).stdout)
        t_added = time.time()
        if not added.get("event"):
            raise Failed(f"layertap add sent no event: {(self.logs / f'add-{name}.log').read_text()[-2000:]}")
        log(f"{name}: add took {t_added - t0:.2f} s; waiting for the triggered run")

        deadline = time.monotonic() + timeout
        run = None
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                new = [r for r in self.flow_runs() if r["id"] not in known]
                if len(new) > 1:
                    raise Failed(f"{len(new)} flow runs were triggered by one event: {[r['name'] for r in new]}")
                if new and new[0]["state"]["type"] in FINAL:
                    run = new[0]
                    break
            time.sleep(0.25)
        t_final_seen = time.time()
        if run is None:
            raise Failed(f"{name}: no finished embed-new-rows run within {timeout:.0f} s")
        if run["state"]["type"] != "COMPLETED":
            raise Failed(f"{name}: flow run {run['name']} ended {run['state']['type']}: "
                         f"{run['state'].get('message')}")
        t_done = self.done_log_time(run["id"])

        from layertap.store.registry import read_status

        history = read_status(self.store, last_runs=50)["runs"]
        recorded = [r for r in history if r["flow_run_id"] == run["id"]]
        if len(recorded) != 1 or recorded[0]["status"] != "completed":
            raise Failed(f"{name}: the store's history has {recorded} for flow run {run['id']}")
        summary = recorded[0]["summary"]
        starts = self.engine_starts()
        published = t_done if t_done is not None else t_final_seen
        occurred = self.event_occurred(added["event"])
        return {
            "phases": {**self.phases(added["event"], occurred, run["id"], published),
                       "create_retries": self.create_retries() - retries_before},
            "file": csv_path,
            "add_s": round(t_added - t0, 3),
            "add_to_published_s": round(published - t0, 3),
            # From the event's own timestamp (when `layertap add` emitted it) to the run's "embed done".
            "event_to_published_s": round(published - occurred, 3) if occurred is not None else None,
            "event_s": since(occurred, t0),
            "add_returned_to_published_s": round(published - t_added, 3),
            "published_from": "flow log" if t_done is not None else "prefect state seen (no flow log found)",
            "add_to_prefect_final_seen_s": round(t_final_seen - t0, 3),
            "flow_run": {
                "id": run["id"], "name": run["name"], "state": run["state"]["type"],
                # Seconds after `layertap add` started: created by the trigger, started running, ended.
                "created_s": since(parse_time(run.get("created")), t0),
                "start_s": since(parse_time(run.get("start_time")), t0),
                "end_s": since(parse_time(run.get("end_time")), t0),
                "total_run_time_s": run.get("total_run_time"),
            },
            "flow_s": recorded[0]["seconds"],
            "summary": {k: summary.get(k) for k in (
                "rows", "new_rows", "new_prompts", "planned", "batches", "embedded", "skipped", "tokens",
                "extract_seconds", "engine_busy_seconds", "engine_idle_seconds", "seconds")},
            "engine_starts_before": starts_before,
            "engine_starts_after": len(starts),
            "engines_started": [{**s, "ready_s": since(s.get("started_at"), t0)} for s in starts[starts_before:]],
        }

    def noop_run(self, timeout: float) -> dict:
        cmd = [sys.executable, "-m", "flows.cli", "run", "--dataset", DATASET, "--store", str(self.store), "--json"]
        t0 = time.perf_counter()
        out = self.run("noop", *cmd, timeout=timeout)
        wall = time.perf_counter() - t0
        summary = json.loads(out.stdout)
        if summary.get("embedded") or summary.get("planned"):
            raise Failed(f"the no-op run found work: {summary}")
        return {"wall_s": round(wall, 3), "summary_seconds": summary.get("seconds"),
                "embedded": summary.get("embedded"), "planned": summary.get("planned"), "rows": summary.get("rows")}


def median(values) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    middle = len(known) // 2
    return round(known[middle] if len(known) % 2 else (known[middle - 1] + known[middle]) / 2, 3)


def machine_name() -> str:
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    return f"cpu {os.cpu_count()} cores"


def git_commit() -> dict:
    if os.environ.get("BENCH_COMMIT"):  # a copy of the tree whose .git is not the one that was measured
        return {"commit": os.environ["BENCH_COMMIT"], "dirty": None}
    with contextlib.suppress(Exception):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    return {"commit": os.environ.get("BENCH_COMMIT"), "dirty": None}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, metavar="DIR", help="where the result JSON goes")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model-dir", metavar="DIR", help="model folder (default: the tiny demo model)")
    which.add_argument("--gpu-model", action="store_true",
                       help="Llama-2-7B-shaped folder, dummy weights, bfloat16, no parity sample")
    parser.add_argument("--dtype", help="dataset dtype (default: bfloat16 with --gpu-model, else layertap's)")
    parser.add_argument("--rows", type=int, default=1000, help="new rows per measured run (default: 1000)")
    parser.add_argument("--done-rows", type=int, default=1000, help="rows embedded before (default: 1000)")
    parser.add_argument("--gpu-latest", metavar="PATH", help="also set this JSON file's incremental_<rows> key")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds per triggered run (default: 1800)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (store, logs) afterwards")
    parser.add_argument("--warm-repeats", type=int, default=1, metavar="N",
                        help="warm runs to measure, each of --rows new rows (default: 1)")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear down on a kill as on Ctrl-C
    work = Path(tempfile.mkdtemp(prefix="lt-incr-"))  # short: warm engines' sockets live under it
    extra_env: dict[str, str] = {}
    dtype = args.dtype
    if args.gpu_model:
        from bench.gpu_extract import LLAMA2_7B, build_model_dir

        model_dir = build_model_dir(work)
        model = {"shape": "Llama-2-7B", **LLAMA2_7B, "weights": "dummy"}
        extra_env.update(LAYERTAP_LOAD_FORMAT="dummy", LAYERTAP_PARITY_SAMPLE="0")
        dtype = dtype or "bfloat16"
    elif args.model_dir:
        model_dir = str(Path(args.model_dir).expanduser().resolve())
        model = {"dir": model_dir}
    else:
        from layertap.model.tiny_model import build_tiny_model

        model_dir = build_tiny_model(work / "tiny-model")
        model = {"shape": "layertap tiny model (llama, 4 layers, hidden 128)"}
    model.update(dtype=dtype or "float32 (default)", layers="all",
                 parity_sample=extra_env.get("LAYERTAP_PARITY_SAMPLE", "8 (default)"))
    first_add = ["--model", model_dir] + (["--dtype", dtype] if dtype else [])

    files = {
        "done": write_csv(work / "done.csv", prompts(0, args.done_rows)),
        "cold": write_csv(work / "new1.csv", prompts(args.done_rows, args.rows)),
    }
    warm_names = ["warm"] + [f"warm{i}" for i in range(2, max(args.warm_repeats, 1) + 1)]
    for i, warm in enumerate(warm_names):
        files[warm] = write_csv(work / f"new{i + 2}.csv", prompts(args.done_rows + (i + 1) * args.rows, args.rows))

    from layertap.runner import warm_engine

    setup = Setup(work, extra_env)
    from flows.serve import POLL_SECONDS

    report: dict = {"command": "python " + " ".join(sys.argv), "model": model, "rows": args.rows,
                    "done_rows": args.done_rows, "work_dir": str(work),
                    "runner_poll_s": POLL_SECONDS}
    ok = False
    try:
        t = time.perf_counter()
        setup.start_server()
        report["server_start_s"] = round(time.perf_counter() - t, 3)
        log(f"prefect server up on port {setup.port} ({report['server_start_s']:.1f} s)")
        t = time.perf_counter()
        setup.start_serve()
        report["serve_ready_s"] = round(time.perf_counter() - t, 3)
        log(f"layertap serve registered its deployments ({report['serve_ready_s']:.1f} s)")

        code_before = warm_engine.layertap_code()
        runs = report["runs"] = {}
        runs["prepare"] = setup.triggered_run("prepare", files["done"], first_add, args.run_timeout)
        prepared = runs["prepare"]
        log(f"prepare: {prepared['summary']['embedded']} embedded in {prepared['add_to_published_s']:.1f} s")
        report["engines_stopped_after_prepare"] = warm_engine.stop_engines(setup.engine_dir)
        if warm_engine.list_engines(setup.engine_dir):
            raise Failed("a warm engine is still up after stopping them")

        for name in ("cold", *warm_names):
            runs[name] = setup.triggered_run(name, files[name], [], args.run_timeout)
            r = runs[name]
            p = r["phases"]
            log(f"{name}: {r['summary']['embedded']} embedded; add {r['add_s']:.2f} s, published "
                f"{r['add_to_published_s']:.2f} s after add started, {r['event_to_published_s']} s after the event "
                f"(created {p.get('event_to_created_s')}, pending {p.get('event_to_pending_s')}, running "
                f"{p.get('event_to_running_s')}; busy retries {p['create_retries']}), flow {r['flow_s']:.2f} s, "
                f"engine busy {r['summary']['engine_busy_seconds']} s, engines started {len(r['engines_started'])}")
            if r["summary"]["embedded"] != args.rows:
                raise Failed(f"{name}: embedded {r['summary']['embedded']}, not {args.rows}")
        runs["noop"] = setup.noop_run(timeout=600)
        log(f"noop: {runs['noop']['wall_s']:.2f} s")
        report["layertap_code_changed_during_bench"] = warm_engine.layertap_code() != code_before
        ok = True
    except Exception as exc:  # noqa: BLE001 - the report says what failed, with the logs' tails
        log(f"FAILED: {type(exc).__name__}: {exc}\n{setup.tail()}")
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        log("tearing down")
        setup.teardown()

    date = dt.date.today().isoformat()
    name = machine_name()
    stamp = {"date": date, "machine": name, **git_commit(),
             **({"note": os.environ["BENCH_NOTE"]} if os.environ.get("BENCH_NOTE") else {})}
    report = {**stamp, **report}
    if ok:
        runs = report["runs"]
        result = {
            "cold_s": runs["cold"]["add_to_published_s"],
            "warm_s": runs["warm"]["add_to_published_s"],
            "noop_s": runs["noop"]["wall_s"],
            "cold_flow_s": runs["cold"]["flow_s"],
            "warm_flow_s": runs["warm"]["flow_s"],
            "cold_engine_busy_s": runs["cold"]["summary"]["engine_busy_seconds"],
            "warm_engine_busy_s": runs["warm"]["summary"]["engine_busy_seconds"],
            "cold_add_s": runs["cold"]["add_s"],
            "warm_add_s": runs["warm"]["add_s"],
            "cold_event_to_published_s": runs["cold"]["event_to_published_s"],
            "warm_event_to_published_s": runs["warm"]["event_to_published_s"],
            "engine_starts_during_cold": len(runs["cold"]["engines_started"]),
            "engine_starts_during_warm": sum(len(runs[w]["engines_started"]) for w in warm_names),
            "warm_phases": runs["warm"]["phases"],
        }
        if len(warm_names) > 1:
            warm_runs = [runs[w] for w in warm_names]
            result.update(
                warm_repeats=len(warm_runs),
                warm_median_s=median(r["add_to_published_s"] for r in warm_runs),
                warm_median_event_to_published_s=median(r["event_to_published_s"] for r in warm_runs),
                warm_median_flow_s=median(r["flow_s"] for r in warm_runs),
                warm_median_phases={key: median(r["phases"].get(key) for r in warm_runs)
                                    for key in runs["warm"]["phases"]},
            )
        report[f"incremental_{args.rows}"] = result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"incremental-{date}-{slug(name)}.json"
    target.write_text(json.dumps(report, indent=1, default=str) + "\n")
    log(f"wrote {target}")
    if not ok:
        log(f"kept {work} (store, logs)")
        return 1

    if args.gpu_latest:
        latest_path = Path(args.gpu_latest)
        latest = json.loads(latest_path.read_text()) if latest_path.is_file() else {}
        latest[f"incremental_{args.rows}"] = {**result, **stamp, "model": model}
        latest_path.parent.mkdir(parents=True, exist_ok=True)
        latest_path.write_text(json.dumps(latest, indent=1, default=str) + "\n")
        log(f"set incremental_{args.rows} in {latest_path}")
    if args.keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)

    warm_ok = result["engine_starts_during_warm"] == 0
    print(f"incremental {args.rows} rows on {name}: cold {result['cold_s']:.2f} s (flow {result['cold_flow_s']:.2f}, "
          f"engine busy {result['cold_engine_busy_s']}), warm {result['warm_s']:.2f} s (flow "
          f"{result['warm_flow_s']:.2f}, engine busy {result['warm_engine_busy_s']}), noop {result['noop_s']:.2f} s"
          + (f"; warm median of {result['warm_repeats']}: {result['warm_median_s']:.2f} s "
             f"({result['warm_median_event_to_published_s']:.2f} s after the event)"
             if result.get("warm_repeats") else "")
          + f"; engines started during warm: {result['engine_starts_during_warm']}"
          + ("" if warm_ok else " (EXPECTED 0)"))
    if not warm_ok:
        log("the warm run started an engine: the cold run's engine was not reused"
            + (" (layertap's code changed during the bench, which changes the engine key)"
               if report.get("layertap_code_changed_during_bench") else ""))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
