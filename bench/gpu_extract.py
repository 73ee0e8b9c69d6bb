"""Side-by-side extraction benchmark on one GPU: Hugging Face, vLLM, and layertap.

Run on the GPU machine (vLLM 0.26 kit staged, repo root on PYTHONPATH):

    python bench/gpu_extract.py --out bench/results

Every mode runs in its own subprocess so one engine's memory never affects the next. The model is
Llama-2-7B-shaped (bf16) with dummy weights (weights' values do not change speed); the tokenizer is
layertap's byte-level one, so prompt lengths in tokens are exact. Workloads are generated from a fixed
seed: 4096 short prompts (~18 tokens) and 2000 medium prompts (~240 tokens). All 33 hidden states,
last-token pooling.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {"short": (4096, 18), "medium": (2000, 240), "short100k": (100_000, 18), "medium20k": (20_000, 240)}
# The per-prompt HF loop and vLLM's file-per-request extractor are measured on a prefix of the workload
# (their cost is linear in prompts; the full set would take minutes or hundreds of GB of /dev/shm).
SUBSET = {"hf_loop": {"short": 256, "medium": 128}, "vllm_extract_hidden_states": {"short": 1024, "medium": 200}}
MODES = ["hf_loop", "hf_batched", "vllm_plain", "layertap", "layertap_runner", "vllm_extract_hidden_states"]
# Not in the default set: where the runner's ceiling lies (vLLM's pooling runner with its own pooler), which
# process placement or host work slows the flow, and what vLLM's model runner version costs (in vLLM 0.26 a
# generating Llama runs on its "V2" model runner, a pooling one on the older V1 runner layertap hooks).
DIAGNOSTIC_MODES = ["layertap_runner_writing", "layertap_runner_in_flow", "layertap_runner_in_process",
                    "layertap_in_process", "vllm_pooling_eager", "vllm_pooling_compiled",
                    "vllm_pooling_inprocess_async", "vllm_plain_v1_runner", "vllm_pooling_v2_runner",
                    "vllm_plain_profiled", "layertap_runner_profiled", "layertap_variants",
                    "layertap_processes_apart"]
BATCH = int(os.environ.get("BENCH_BATCH_SIZE", "1024"))
IN_FLIGHT = int(os.environ.get("BENCH_IN_FLIGHT", "4"))
# Every vLLM-based mode runs its workload this many times on one engine and reports the last pass: the
# first large pass after start-up pays one-off costs (kernel selection for new shapes, allocator growth)
# that a long-lived worker pays once. The first pass's time is reported beside it. Each pass has prompts of
# its own (same sizes, other words), so no pass finds its prompts in the engine's prefix cache.
PASSES = int(os.environ.get("BENCH_PASSES", "2"))
# "dummy": random weights drawn by vLLM at load (weights' values do not change the engine's speed); "auto":
# the weights saved in the model folder (`--weights random`), so the store holds realistic bytes and the
# parity sample has a reference.
LOAD_FORMAT = os.environ.get("BENCH_LOAD_FORMAT", "dummy")
# The flow's parity sample: the product's default (8) where the model has weights to compare against.
PARITY_SAMPLE = int(os.environ.get("BENCH_PARITY_SAMPLE", "0" if LOAD_FORMAT == "dummy" else "8"))
# How often the flow's engine counters are sampled (seconds); below 0.5 the samples carry CPU seconds too.
TIMELINE_EVERY = float(os.environ.get("BENCH_TIMELINE_EVERY", "0.5"))
# Modes that start one engine and run every workload on it, one after another (start-up is paid once).
SESSION_MODES = ("vllm_plain", "layertap_runner", "layertap", "layertap_float16", "layertap_variants")
LLAMA2_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)
WORDS = ("the of and to in is was for on that with as by at from his an were are which this be has or had "
         "model layer probe vector state token river cloud paper signal garden engine window theory market "
         "violet silent ancient rapid golden hollow bright narrow gentle frozen").split()


def make_prompts(workload: str, variant: int = 0) -> list[str]:
    """Deterministic English-like prompts whose byte-level token count is about the target (BOS included);
    each variant draws other words, so variants share no prefix block."""
    count, tokens = WORKLOADS[workload]
    rng = random.Random(f"layertap-{workload}" + (f"-{variant}" if variant else ""))
    prompts = []
    for i in range(count):
        target = max(4, int(rng.gauss(tokens, tokens * 0.15))) - 1
        words = [f"#{i}"]
        while len(" ".join(words)) < target:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words)[:target])
    return prompts


def build_model_dir(root: Path) -> str:
    """A config of the real shape plus layertap's byte-level tokenizer; no weights (loaded as dummy)."""
    from transformers import LlamaConfig

    from layertap.model.tiny_model import _byte_level_tokenizer

    path = root / "llama2-7b-shape"
    config = LlamaConfig(**LLAMA2_7B, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    config.save_pretrained(path)
    _byte_level_tokenizer().save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------------------------------
# modes (each runs in a fresh process)

def run_hf(model_dir: str, prompts: list[str], batched: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    config = LlamaConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    start = time.perf_counter()
    results = []
    with torch.inference_mode():
        if not batched:
            for text in prompts:
                enc = tok(text, return_tensors="pt").to("cuda")
                out = model.generate(**enc, output_hidden_states=True, return_dict_in_generate=True,
                                     max_new_tokens=1, do_sample=False, pad_token_id=2)
                first_step = out.hidden_states[0]  # prefill step: one tensor per layer
                results.append([h[0, -1].float().cpu().tolist() for h in first_step])
        else:
            tok.padding_side = "left"
            for i in range(0, len(prompts), 64):
                enc = tok(prompts[i:i + 64], return_tensors="pt", padding=True).to("cuda")
                hidden = model(**enc, output_hidden_states=True).hidden_states
                results.append(torch.stack([h[:, -1] for h in hidden], dim=1).float().cpu())
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start}


def _passes(run, prompt_sets: list[list[str]]) -> dict:
    """Time `run(prompts)` once per prompt set; the last pass is the one reported, with the CPU each process
    used during it."""
    times = []
    for prompts in prompt_sets:
        cpu_before = _cpu_seconds()
        with GpuBusy() as gpu, RssSampler() as rss:
            start = time.perf_counter()
            run(prompts)
            times.append(time.perf_counter() - start)
    cpu = _cpu_used(cpu_before, _cpu_seconds(), times[-1])
    return {"seconds": times[-1], "first_pass_s": times[0], "passes": len(times), "cpu_last_pass": cpu,
            "gpu_utilisation_last_pass_pct": gpu.mean, "peak_pss_of_process_tree_during_run_gib": rss.tree_peak}


def session_vllm_plain(model_dir: str):
    """Plain generate(max_tokens=1): the engine started once; `measure(prompt_sets)` runs a workload on it.
    Start-up counts from the first import of vLLM, as for every mode."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    from layertap.runner import vllm_seam

    llm = LLM(model=model_dir, load_format=LOAD_FORMAT, dtype="bfloat16")
    startup = time.perf_counter() - t0
    llm.generate([f"warm-up prompt number {i}" for i in range(64)], SamplingParams(max_tokens=1), use_tqdm=False)
    steps = {"steps": 0, "stepping_s": 0.0, "first_step_at_s": None}

    def timed(step):
        def timed_step():  # how long generate spends adding its requests before the first step, and stepping
            started = time.perf_counter()
            if steps["first_step_at_s"] is None:
                steps["first_step_at_s"] = started - steps.pop("called")
            try:
                return step()
            finally:
                steps["steps"] += 1
                steps["stepping_s"] += time.perf_counter() - started
        return timed_step

    def run(prompts):
        steps.update(steps=0, stepping_s=0.0, first_step_at_s=None, called=time.perf_counter())
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)

    vllm_seam.wrap_steps(llm, timed)
    started = {"startup_s": startup, **vllm_seam.engine_config(llm)}

    def measure(prompt_sets: list[list[str]]) -> dict:
        with PySpy(f"vllm_plain-{len(prompt_sets[-1])}") as profile:
            timing = _passes(run, prompt_sets)
        return {**timing, "last_pass_engine_thread": dict(steps),
                **({"pyspy_all_passes": profile.summary} if profile.summary else {})}

    return started, measure


def run_vllm_plain(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    started, measure = session_vllm_plain(model_dir)
    return {**started, **measure(prompt_sets)}


def run_vllm_plain_v1_runner(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """Plain generate on vLLM's V1 model runner, the one a pooling engine (layertap's) runs on in vLLM 0.26:
    against `vllm_plain` (V2), what the runner version alone costs."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return run_vllm_plain(model_dir, prompt_sets)


def _engine_kind(llm) -> dict:
    """Which of vLLM's model runners the engine uses and whether it schedules asynchronously."""
    from layertap.runner import vllm_seam

    config = vllm_seam.engine_config(llm)
    return {"model_runner": config["model_runner"], "async_scheduling": config["async_scheduling"]}


def _memory_gib() -> dict[str, float]:
    """VmRSS and its parts: anonymous (heaps, Arrow, torch), file-backed (libraries), shared (host buffers);
    and what Arrow's memory pool has allocated (part of anonymous)."""
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            name = line.split(":", 1)[0]
            if name in wanted:
                found[wanted[name]] = int(line.split()[1]) / 2**20
    if "pyarrow" in sys.modules:
        found["arrow"] = sys.modules["pyarrow"].total_allocated_bytes() / 2**30
    return found


def _rss_gib() -> float:
    return _memory_gib().get("rss", float("nan"))


def _descendants(root: int) -> list[int]:
    """Pids of every process started under `root` (the engine core, Prefect's server), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _tree_pss_gib() -> dict[str, float]:
    """Proportional set size of this process and each process under it, keyed "name pid" ("self" for this
    one), and their total: shared pages (the host buffers both the flow and the engine core map) are
    split between the processes that map them, so the total counts each page once, unlike summed RSS."""
    found = {name: parts["pss"] for name, parts in _tree_pss_parts_gib().items()}
    found["total"] = round(sum(found.values()), 3)
    return found


def _tree_pss_parts_gib() -> dict[str, dict[str, float]]:
    """Per process of the tree (as `_tree_pss_gib` names them; a profiler's own process left out), its PSS
    and the anonymous, file-backed and shared-memory parts of it."""
    wanted = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}
    found = {}
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        try:
            with open(f"/proc/{pid}/comm") as comm:
                name = comm.read().strip()
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                parts = {wanted[line.split()[0]]: round(int(line.split()[1]) / 2**20, 3)
                         for line in rollup if line.split()[:1] and line.split()[0] in wanted}
        except (OSError, IndexError, ValueError):
            continue
        if name != "py-spy" and "pss" in parts:
            found["self" if pid == os.getpid() else f"{name} {pid}"] = parts
    return found


def _process_name(pid: int, comm: str) -> str:
    """How a report names a process of the mode: "self" for this one, "<name> <pid>" for the others."""
    return "self" if pid == os.getpid() else f"{comm} {pid}"


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process and each process under it, keyed "name pid"
    ("self" for this one), and by the whole host ("host", every core's non-idle time): taken before and
    after a run, they say which process had the cores and whether the host ran out of them."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in [os.getpid(), *_descendants(os.getpid())]:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        comm, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()
        found[_process_name(pid, comm)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    with open("/proc/stat") as stat:
        cpu = [int(v) for v in stat.readline().split()[1:]]
    found["host"] = (sum(cpu) - cpu[3] - cpu[4]) / tick  # all but idle and iowait
    return found


def _cpu_used(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """CPU seconds each process (and the host) used between two `_cpu_seconds` readings, with the host's
    cores and the wall seconds between them."""
    used = {name: round(after[name] - before.get(name, 0.0), 2) for name in after}
    return {"wall_s": round(seconds, 2), "cores": os.cpu_count(), "cpu_s": used}


class RssSampler:
    """Peak resident memory while a block runs, sampled every 50 ms (ru_maxrss also counts engine start),
    with its parts at that moment (`at_peak`) and every `every` seconds (`timeline`: where growth happens);
    and the peak of the whole process tree's PSS, every `tree_every` seconds (`tree_peak`)."""

    def __init__(self, every: float = 2.0, tree_every: float = 1.0):
        self.every, self.tree_every = every, tree_every
        self.timeline: list[dict[str, float]] = []
        # The whole process tree (`_tree_pss_gib`), sampled less often: reading smaps is dearer.
        self.tree_peak: dict[str, float] = {}
        self.tree_timeline: list[dict[str, float]] = []

    def __enter__(self):
        import threading

        self.at_peak = _memory_gib()
        self.peak, self._stop = self.at_peak.get("rss", float("nan")), threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        noted, tree_noted = -self.every, -self.tree_every
        while not self._stop.wait(0.05):
            at = time.perf_counter() - self._started
            if at - tree_noted >= self.tree_every:
                tree = _tree_pss_gib()
                if tree["total"] > self.tree_peak.get("total", 0.0):
                    self.tree_peak = tree
                self.tree_timeline.append({"s": round(at, 1), **tree})
                tree_noted = at
            now = _memory_gib()
            if now.get("rss", 0.0) > self.peak:
                self.peak, self.at_peak = now["rss"], now
            if at - noted >= self.every:
                self.timeline.append({"s": round(at, 1), **{k: round(v, 3) for k, v in now.items()}})
                noted = at

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class GpuBusy:
    """The GPU's utilisation (NVML: the share of time a kernel was running) sampled every 0.2 s while a block
    runs; `mean` is None where NVML cannot be read."""

    def __enter__(self):
        import threading

        self.samples, self.mean = [], None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._read = functools.partial(pynvml.nvmlDeviceGetUtilizationRates, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:  # noqa: BLE001 - no NVML: nothing sampled
            self._read = None
            return self
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.2):
            self.samples.append(self._read().gpu)

    def __exit__(self, *exc):
        if self._read is not None:
            self._stop.set()
            self._thread.join()
            self.mean = round(sum(self.samples) / len(self.samples), 1) if self.samples else None


class PySpy:
    """py-spy sampling this process and every process under it (the runner, vLLM's engine core, Prefect's
    server) while a block runs: native frames, thread names, running threads only, as raw collapsed stacks
    in `<BENCH_PYSPY_DIR>/pyspy-<name>.txt`; `summary` is `pyspy_summary.summarise` of them. Off unless
    `BENCH_PYSPY` names the py-spy binary. Each sample pauses the process it reads: a profiled run is
    slower than an unprofiled one, so its timings are not the mode's."""

    def __init__(self, name: str):
        self.name, self.binary, self.summary = name, os.environ.get("BENCH_PYSPY"), None
        self.rate = float(os.environ.get("BENCH_PYSPY_RATE", "50"))

    def __enter__(self):
        if not self.binary:
            return self
        folder = Path(os.environ.get("BENCH_PYSPY_DIR") or tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"pyspy-{self.name}.txt"
        self._proc = subprocess.Popen(
            [self.binary, "record", "--pid", str(os.getpid()), "--subprocesses", "--native", "--threads",
             "--rate", str(int(self.rate)), "--format", "raw", "--output", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(2.0)  # attached to every process before the block starts
        return self

    def __exit__(self, *exc):
        if not self.binary:
            return
        self._proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        try:
            _, errors = self._proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, errors = self._proc.communicate()
        from pyspy_summary import summarise

        self.summary = (summarise(self.path, self.rate) if self.path.exists()
                        else {"error": f"py-spy wrote nothing: {errors[-2000:]}"})


def gc_pauses(since: float, until: float, runner_pid: int | None = None) -> dict:
    """Per process of the mode, the garbage-collector passes of 10 ms or more that ended between two epoch
    times: how many, their milliseconds in all and the longest (with `BENCH_GC_TRACE`). Processes are named
    as in `_cpu_seconds`, the runner process as "runner <pid>"."""
    found = {}
    for log in sorted(Path(os.environ.get("BENCH_GC_TRACE") or "/nonexistent").glob("gc-*.log")):
        pid, script = log.stem[3:].split("-", 1)
        passes = [line.split() for line in log.read_text().splitlines()]  # "<epoch s> <generation> <ms> ..."
        ms = [float(fields[2]) for fields in passes if since <= float(fields[0]) <= until]
        if not ms:
            continue
        try:
            comm = "runner" if int(pid) == runner_pid else Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            comm = script  # the process is gone
        found[_process_name(int(pid), comm)] = {"passes": len(ms), "total_ms": round(sum(ms)),
                                                "max_ms": round(max(ms))}
    return found


def _activity_between(before, after) -> dict:
    """What the runner's engine thread did between two `activity()` readings, as plain data."""
    used = after.since(before)
    return {"steps": used.steps, "stepping_s": round(used.stepping_s, 3), "idle_s": round(used.idle_s, 3)}


class ActivityTimeline:
    """The runner's engine counters every `every` seconds while a block runs: when the engine waited for
    work (the run's start, its end, or batches held back between). Sampled finely (`BENCH_TIMELINE_EVERY`
    below 0.5 s), each sample also carries the CPU seconds of every process under this one (`cpu`), and
    `long_steps` finds the stretches where the engine neither finished a step nor waited for work."""

    def __init__(self, runner, every: float = 0.5):
        self.runner, self.every, self.samples, self.cpu = runner, every, [], []

    def __enter__(self):
        import threading

        self._stop, self._started = threading.Event(), time.perf_counter()
        self.started_epoch = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while True:
            now = self.runner.activity()
            at = round(time.perf_counter() - self._started, 2)
            self.samples.append([at, now.steps, round(now.stepping_s, 3), round(now.idle_s, 3), now.in_engine])
            if self.every < 0.5:
                self.cpu.append({"s": at, **{name: round(v, 2) for name, v in _cpu_seconds().items()}})
            if self._stop.wait(self.every):
                return

    def long_steps(self, at_least: float = 0.3) -> list[list[float]]:
        """[start s, seconds] of each stretch of at least `at_least` s in which no step finished and the
        engine did not wait for work: one step that took that long (or the engine thread held up)."""
        found, since = [], None
        for before, after in zip(self.samples, self.samples[1:]):
            stuck = after[1] == before[1] and after[3] - before[3] < 0.5 * (after[0] - before[0])
            if stuck and since is None:
                since = before[0]
            elif not stuck and since is not None:
                if before[0] - since >= at_least:
                    found.append([since, round(before[0] - since, 2)])
                since = None
        return found

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class PhaseTimes:
    """Time spent inside a batch's task phases (summed over batches, which overlap): the engine, the in-memory
    value checks, the Parquet write, and the written files' checks (validate-batch, on a worker thread); and
    in the flow's own steps, which run one after another on the flow's thread (`_extracted` is the wait for
    a batch's extraction). Says what bounds it."""

    FLOW_STEPS = ("ingest", "normalise", "register_extraction", "plan", "_extracted", "validate_store")

    def __enter__(self):
        import threading

        import layertap.batch as extract_task

        import flows.pipeline as pipeline

        self.seconds = {"engine": 0.0, "check_values": 0.0, "write_files": 0.0, "check_files": 0.0,
                        "publish_store": 0.0}
        self.flow_steps = {name: 0.0 for name in self.FLOW_STEPS}
        self._lock, self._module, self._pipeline = threading.Lock(), extract_task, pipeline
        self._originals = {"extract_splitting": extract_task.extract_splitting,
                           "write_batch_files": extract_task.write_batch_files}
        self._flow_originals = {name: getattr(pipeline, name) for name in self.FLOW_STEPS}
        self._check = extract_task.checks.check_vectors
        extract_task.extract_splitting = self._timed("engine", extract_task.extract_splitting)
        extract_task.write_batch_files = self._timed("write_files", extract_task.write_batch_files)
        extract_task.checks.check_vectors = self._timed("check_values", self._check)
        self._validate = pipeline.validate_batch  # a submitted task: its body is timed on its worker thread
        self._validate_body = self._validate.fn
        self._validate.fn = self._timed("check_files", self._validate_body)
        self._publish = pipeline.publish_batches  # its body (the store transaction), without Prefect's task run
        self._publish_body = self._publish.fn
        self._publish.fn = self._timed("publish_store", self._publish_body)
        for name, fn in self._flow_originals.items():
            setattr(pipeline, name, self._timed(name, fn, self.flow_steps))
        return self

    def _timed(self, phase, fn, into=None):
        into = self.seconds if into is None else into

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    into[phase] += time.perf_counter() - start
        return timed

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(self._module, name, fn)
        for name, fn in self._flow_originals.items():
            setattr(self._pipeline, name, fn)
        self._module.checks.check_vectors = self._check
        self._validate.fn = self._validate_body
        self._publish.fn = self._publish_body


_HELD = contextlib.ExitStack()


def session_layertap(model_dir: str, engine_process: bool | None = None, runner_process: bool | None = None,
                     store_dtype: str | None = None):
    """End to end through the `embed` flow: ingest, normalise, plan, extract, write Parquet, validate (with
    the parity sample where the model has weights), publish, then read the last layer back through `Store`.
    The engine is started (and timed) by a warm-up run and kept for every measured run, as a worker process
    keeps it between batches (with it the parity reference the warm-up run loaded, as a kept engine keeps
    it); `measure(prompt_sets)` runs a workload's flow calls on it. The warm-up run goes
    through `flows.cli.run_flow`, as `layertap run` does (its engine starts while Prefect starts)."""
    t0 = time.perf_counter()
    import shutil

    from layertap import Store  # first, as the product's entry points import it: it picks Arrow's memory pool

    import pyarrow as pa
    import pyarrow.csv as pacsv

    os.environ["LAYERTAP_LOAD_FORMAT"] = LOAD_FORMAT
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.cli import run_flow
    from flows.embed import embed_flow
    from layertap.runner import engine_cache
    from layertap.settings import load_settings

    common = dict(model=model_dir, layers="all", pooling="last", dtype="bfloat16", parity_sample=PARITY_SAMPLE,
                  batch_size=BATCH, batches_in_flight=IN_FLIGHT, engine_process=engine_process,
                  runner_process=runner_process, store_dtype=store_dtype)
    _HELD.enter_context(engine_cache.pin())  # engines kept until the process exits
    work = Path(tempfile.mkdtemp(prefix="layertap-bench-"))
    warm = work / "warm.csv"
    pacsv.write_csv(pa.table({"text": [f"warm-up prompt number {i}" for i in range(64)]}), warm)
    run_flow(load_settings(env_file=None, input=[str(warm)], store=str(work / "warm-store"), **common))
    startup = time.perf_counter() - t0
    runner = next(iter(engine_cache._runners.values()))
    started = {"startup_and_warmup_s": startup, "batch_size": BATCH, "batches_in_flight": IN_FLIGHT,
               "parity_sample": PARITY_SAMPLE, "store_dtype": store_dtype or "float32",
               "part_file_mb": load_settings(env_file=None).part_file_mb,
               "engine_process": runner.engine_process, "engine_core_start": runner.engine_core_start,
               "runner_process": getattr(runner, "runner_process", False)}

    def measure(prompt_sets: list[list[str]], **overrides) -> dict:
        settings = {**common, **overrides}
        data = []
        for k, prompts in enumerate(prompt_sets):
            data.append(work / f"prompts-{k}.csv")
            pacsv.write_csv(pa.table({"text": prompts}), data[-1])
        prompts = prompt_sets[-1]
        first_pass = None
        for extra in range(len(prompt_sets) - 1):  # earlier passes go to stores of their own: nothing is skipped
            start = time.perf_counter()
            embed_flow(input=[str(data[extra])], store=str(work / f"store-pass{extra}"), **settings)
            first_pass = first_pass or time.perf_counter() - start
            shutil.rmtree(work / f"store-pass{extra}", ignore_errors=True)
        memory_before = _memory_gib()
        activity = runner.activity()
        cpu_before = _cpu_seconds()
        store = work / "store"
        with PySpy(f"layertap-{len(prompts)}") as profile, RssSampler() as rss, PhaseTimes() as phases, \
                ActivityTimeline(runner, TIMELINE_EVERY) as timeline, GpuBusy() as gpu:
            start, start_epoch = time.perf_counter(), time.time()
            summary = embed_flow(input=[str(data[-1])], store=str(store), **settings)
            flow_call = time.perf_counter() - start  # the flow's own seconds plus Prefect's start and exit
            tree_at_end = _tree_pss_parts_gib()
        cpu = _cpu_used(cpu_before, _cpu_seconds(), flow_call)
        engine = runner.activity()
        with RssSampler() as read_rss:  # reading a whole layer back holds it in memory: sampled apart
            table = Store(store).embeddings(layer=-1)
            seconds = time.perf_counter() - start
        files = [f for f in store.rglob("*") if f.is_file()]
        store_bytes = sum(f.stat().st_size for f in files)
        parquet_files = sum(f.suffix == ".parquet" for f in files)
        assert table.num_rows == summary["embedded"] == len(set(prompts)), (table.num_rows, summary)
        del table
        shutil.rmtree(store, ignore_errors=True)
        for path in data:
            path.unlink()
        # The run ends when the flow returns: its results are then published and readable. Reading a whole
        # layer back (1.6 GB for 100,000 prompts) is a reader's work, timed apart.
        return {"seconds": flow_call, "seconds_with_read_back": seconds, "first_pass_s": first_pass or flow_call,
                "passes": len(prompt_sets), "flow_seconds": summary["seconds"], "flow_call_s": flow_call,
                "read_back_s": seconds - flow_call, "embedded": summary["embedded"],
                "store_bytes": store_bytes, "parquet_files": parquet_files,
                "capture_buffer_bytes": runner.capture_buffer_bytes,
                "task_phase_seconds_summed_over_batches": phases.seconds,
                "engine_thread": {**_activity_between(activity, engine), "extract_phase_s": summary["extract_seconds"]},
                "cpu_during_flow_call": cpu, "gpu_utilisation_during_flow_call_pct": gpu.mean,
                "engine_timeline_t_steps_stepping_idle_in_engine": timeline.samples,
                "engine_timeline_started_epoch_s": timeline.started_epoch,
                "engine_timeline_cpu_s": timeline.cpu, "gpu_busy_pct_timeline": gpu.samples,
                "long_steps": timeline.long_steps(),
                "gc_pauses_during_flow_call": gc_pauses(start_epoch, start_epoch + flow_call,
                                                        getattr(runner, "pid", None)),
                "summary_engine_s": {k: summary.get(k) for k in ("engine_busy_seconds", "engine_idle_seconds")},
                "flow_step_seconds_on_flow_thread": phases.flow_steps,
                "host_buffers_allocated": runner.host_buffers_allocated,
                "rss_before_run_gib": memory_before.get("rss", float("nan")), "peak_rss_during_run_gib": rss.peak,
                "memory_before_run_gib": memory_before, "memory_at_peak_during_run_gib": rss.at_peak,
                "memory_timeline_gib": rss.timeline,
                "peak_pss_of_process_tree_during_run_gib": rss.tree_peak,
                "tree_pss_timeline_gib": rss.tree_timeline, "tree_pss_parts_at_end_gib": tree_at_end,
                "peak_rss_reading_last_layer_back_gib": read_rss.peak,
                "peak_rss_since_process_start_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                **({"pyspy_during_flow_call": profile.summary} if profile.summary else {})}

    return started, measure


def run_layertap(model_dir: str, prompt_sets: list[list[str]], engine_process: bool | None = None,
                 runner_process: bool | None = None) -> dict:
    started, measure = session_layertap(model_dir, engine_process, runner_process)
    return {**started, **measure(prompt_sets)}


def session_layertap_float16(model_dir: str):
    """The flow storing float16 (`--store-dtype float16`): half the bytes to encode and write."""
    return session_layertap(model_dir, store_dtype="float16")


def session_layertap_variants(model_dir: str):
    """The flow on one engine, once per variant in `BENCH_VARIANTS` (a JSON list of settings to change, each
    with a "name", and "encoder_threads" for the flow's Parquet encoders; default: as is, without the parity
    sample, with 3 batches in flight, with 8 encoders, and as is again): what each costs in speed and memory,
    measured on one machine and one engine."""
    variants = json.loads(os.environ.get("BENCH_VARIANTS") or json.dumps(
        [{"name": "default"}, {"name": "no-parity", "parity_sample": 0}, {"name": "in-flight-3", "batches_in_flight": 3},
         {"name": "encoders-8", "encoder_threads": 8}, {"name": "default-again"}]))
    started, measure = session_layertap(model_dir)

    def measure_variants(prompt_sets: list[list[str]]) -> dict:
        from layertap.parts.writer import encoder_threads, limit_encoder_threads

        every_core = encoder_threads()
        results = {}
        for variant in variants:
            overrides = {k: v for k, v in variant.items() if k not in ("name", "encoder_threads")}
            limit_encoder_threads(variant.get("encoder_threads", every_core))
            results[variant["name"]] = {"settings": overrides, "encoder_threads": encoder_threads(),
                                        **measure(prompt_sets, **overrides)}
            print(variant["name"], round(results[variant["name"]]["seconds"], 2), "s", flush=True)
        first = next(iter(results.values()))
        return {"seconds": first["seconds"], "variants": results}

    return started, measure_variants


def _extract_and_release(runner, prompts: list[str], layers: list[int]) -> int:
    """One batch, its host buffer handed back for the next one as the flow does once a part is written."""
    result = runner.extract(prompts, layers, "last")
    result.release()
    return len(result.kept)


def _in_batches(runner, prompts: list[str], layers: list[int]) -> None:
    """Every prompt through the runner in batches submitted from several threads at once, as the flow does,
    so the engine never drains between them."""
    from concurrent.futures import ThreadPoolExecutor

    batches = [prompts[i:i + BATCH] for i in range(0, len(prompts), BATCH)]
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        done = sum(pool.map(lambda batch: _extract_and_release(runner, batch, layers), batches))
    assert done == len(prompts)


def session_layertap_runner(model_dir: str, engine_process: bool | None = None):
    """The hooked runner alone: vectors for every prompt in host memory, no store. Batches are submitted
    from several threads at once, as the flow does, so the engine never drains between them. The engine
    starts once; `measure(prompt_sets)` runs a workload on it. Once the engine is up this process freezes
    its heap out of garbage collection, as the runner process serving a flow does."""
    t0 = time.perf_counter()
    from layertap.runner.runner_service import freeze_startup_heap
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    overrides = json.loads(os.environ.get("BENCH_ENGINE_OPTIONS", "{}"))  # e.g. {"max_num_seqs": 2048}
    options = {"dtype": "bfloat16", "load_format": LOAD_FORMAT, "engine_process": engine_process, **overrides}
    runner = VllmRunner(EngineOptions(model=model_dir, **options))
    freeze_startup_heap()
    startup = time.perf_counter() - t0
    layers = list(range(runner.num_layers + 1))
    runner.extract([f"warm-up prompt number {i}" for i in range(64)], layers, "last").release()
    runner.reserve_host_buffers(BATCH, len(layers), IN_FLIGHT)  # as the flow's extract task does

    def run(prompts):
        _in_batches(runner, prompts, layers)

    def measure(prompt_sets: list[list[str]]) -> dict:
        activity = runner.activity()
        with PySpy(f"layertap_runner-{len(prompt_sets[-1])}") as profile:
            timing = _passes(run, prompt_sets)
        timing["engine_thread_all_passes"] = _activity_between(activity, runner.activity())
        return {**timing, "capture_buffer_bytes": runner.capture_buffer_bytes,
                "host_buffers_allocated": runner.host_buffers_allocated,
                **({"pyspy_all_passes": profile.summary} if profile.summary else {})}

    from layertap.runner import vllm_seam

    config = vllm_seam.engine_config(runner.llm)
    return {"startup_s": startup, "step_tokens": runner.step_tokens, "batch_size": BATCH,
            "batches_in_flight": IN_FLIGHT, "engine_options": overrides, **_engine_kind(runner.llm),
            "gpu_memory_utilization": config["gpu_memory_utilization"],
            "engine_process": runner.engine_process, "engine_core_start": runner.engine_core_start}, measure


def run_layertap_runner(model_dir: str, prompt_sets: list[list[str]], engine_process: bool | None = None) -> dict:
    started, measure = session_layertap_runner(model_dir, engine_process)
    return {**started, **measure(prompt_sets)}


def run_layertap_runner_writing(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """The hooked runner plus each batch's host work as the extract task does it (value checks beside the
    Parquet files, written to a scratch store), without Prefect or the store's database: which of the two
    slows the engine in the flow's process."""
    import hashlib
    import shutil
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from layertap.runner.vllm_runner import EngineOptions, VllmRunner
    from layertap.parts.checks import check_vectors
    from layertap.parts.writer import part_id_for, write_batch_files

    t0 = time.perf_counter()
    runner = VllmRunner(EngineOptions(model=model_dir, dtype="bfloat16", load_format=LOAD_FORMAT))
    startup = time.perf_counter() - t0
    layers = list(range(runner.num_layers + 1))
    runner.extract(prompt_sets[0][:64], layers, "last").release()  # warm-up
    runner.reserve_host_buffers(BATCH, len(layers), IN_FLIGHT)
    scratch = Path(tempfile.mkdtemp(prefix="layertap-bench-parts-"))
    checkers = ThreadPoolExecutor(thread_name_prefix="bench-check")
    seconds, lock = {"engine": 0.0, "write_files": 0.0}, threading.Lock()

    def one_batch(k_prompts):
        k, prompts = k_prompts
        started = time.perf_counter()
        result = runner.extract(prompts, layers, "last")
        engine = time.perf_counter() - started
        hashes = [hashlib.sha256(prompts[i].encode()).hexdigest() for i in result.kept]
        checked = checkers.submit(check_vectors, result.vectors, layers, len(hashes), runner.hidden_size)
        started = time.perf_counter()
        write_batch_files(scratch, "bench", part_id_for("bench", layers, f"batch-{k}"), hashes, result.vectors,
                          "bfloat16", max_file_bytes=128_000_000)
        written = time.perf_counter() - started
        checked.result()
        result.release()
        with lock:
            seconds["engine"] += engine
            seconds["write_files"] += written
        return len(hashes)

    def run(prompts):
        batches = list(enumerate(prompts[i:i + BATCH] for i in range(0, len(prompts), BATCH)))
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            done = sum(pool.map(one_batch, batches))
        assert done == len(prompts)

    with RssSampler() as rss:
        timing = _passes(run, prompt_sets)
    parquet_bytes = sum(f.stat().st_size for f in scratch.rglob("*.parquet"))
    shutil.rmtree(scratch, ignore_errors=True)
    return {**timing, "startup_s": startup, "batch_size": BATCH, "batches_in_flight": IN_FLIGHT,
            "seconds_summed_over_batches": seconds, "parquet_bytes_all_passes": parquet_bytes,
            "peak_rss_during_run_gib": rss.peak, "engine_process": runner.engine_process}


def run_layertap_runner_in_process(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """The hooked runner with vLLM's engine core in the calling process (`--no-engine-process`)."""
    return run_layertap_runner(model_dir, prompt_sets, engine_process=False)


def run_layertap_in_process(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """The flow end to end with the runner and vLLM's engine core in the flow's process
    (`--no-runner-process --no-engine-process`)."""
    return run_layertap(model_dir, prompt_sets, engine_process=False, runner_process=False)


def run_layertap_processes_apart(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """The flow end to end with the runner and vLLM's engine core each in a process of its own, as on a GPU
    (`--runner-process --engine-process`), on any machine: the GPU's placement tried on a CPU."""
    return run_layertap(model_dir, prompt_sets, engine_process=True, runner_process=True)


def run_layertap_runner_in_flow(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """The flow end to end with the runner in the flow's process and vLLM's engine core in its own
    (`--no-runner-process`: the default on a GPU until 2026-12-04)."""
    return run_layertap(model_dir, prompt_sets, runner_process=False)


def _vllm_pooling(model_dir: str, prompt_sets: list[list[str]], **options) -> dict:
    """vLLM's pooling runner with its own last-token pooler (one layer, nothing else captured): the base the
    hooked runner rides on, under the settings given."""
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, runner="pooling", convert="embed", dtype="bfloat16", load_format=LOAD_FORMAT, **options)
    startup = time.perf_counter() - t0
    llm.encode(prompt_sets[0][:64], pooling_task="embed", use_tqdm=False)  # warm-up
    timing = _passes(lambda prompts: llm.encode(prompts, pooling_task="embed", use_tqdm=False), prompt_sets)
    return {**timing, "startup_s": startup, "options": options, **_engine_kind(llm)}


def run_vllm_pooling_eager(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    return _vllm_pooling(model_dir, prompt_sets, enforce_eager=True)


def run_vllm_pooling_compiled(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    return _vllm_pooling(model_dir, prompt_sets)


def run_vllm_pooling_inprocess_async(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """As the hooked runner drives it: engine core in this process, asynchronous scheduling, compiled."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return _vllm_pooling(model_dir, prompt_sets, async_scheduling=True)


def run_vllm_pooling_v2_runner(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """vLLM's own last-token pooling on its V2 model runner (asked for; pooling engines default to V1), compiled,
    asynchronous scheduling: against `vllm_pooling_compiled`, what a capture hooked into V2 could gain."""
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return _vllm_pooling(model_dir, prompt_sets, async_scheduling=True)


# Calls into the CUDA runtime that make the host wait for the device (or may: a free, a pageable copy), and the
# allocations and page-locking that can stall a step when they happen inside one.
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaHostRegister", "cudaFreeHost")
PROFILE_PROMPTS = int(os.environ.get("BENCH_PROFILE_PROMPTS", "20000"))
PROFILED_MODES = ("vllm_plain_profiled", "layertap_runner_profiled")


def _gpu_gaps(events) -> dict:
    """Where the device had no kernel or copy running between the first and last it ran: the seconds in gaps
    longer than 1 ms, their count and the ten longest (start in seconds from the first kernel, length in ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not spans:
        return {"kernels": 0}
    origin, busy_until, gaps = spans[0][0], spans[0][1], []
    for start, end in spans[1:]:
        if start - busy_until > 1000:  # microseconds
            gaps.append((busy_until - origin, start - busy_until))
        busy_until = max(busy_until, end)
    return {"kernels": len(spans), "span_s": round((busy_until - origin) / 1e6, 3),
            "gap_s_over_1ms": round(sum(g for _, g in gaps) / 1e6, 3), "gaps_over_1ms": len(gaps),
            "longest_gaps_at_s_ms": [(round(at / 1e6, 3), round(gap / 1e3, 1))
                                     for at, gap in sorted(gaps, key=lambda g: -g[1])[:10]]}


def _profiled(run, prompts: list[str], in_engine_thread=lambda fn: fn()) -> dict:
    """One pass under torch's profiler (host and device), summarised: device gaps, the host's calls that wait
    for the device, and the host operations that took the most time. The engine must run in this process;
    host operations are recorded on the thread that drives it (`in_engine_thread` runs a call there)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    in_engine_thread(prof.__enter__)
    try:
        start = time.perf_counter()
        run(prompts)
        seconds = time.perf_counter() - start
    finally:
        in_engine_thread(lambda: prof.__exit__(None, None, None))
    averages = prof.key_averages()
    waiting = {a.key: {"calls": a.count, "host_ms": round(a.cpu_time_total / 1e3, 1)}
               for a in averages if a.key in WAITING_CALLS}
    top = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:20]
    return {"seconds": seconds, "device": _gpu_gaps(prof.events()),
            "waiting_calls": waiting,
            "top_host_self_ms": [(a.key, a.count, round(a.self_cpu_time_total / 1e3, 1)) for a in top]}


def run_vllm_plain_profiled(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """Plain generate, engine core in this process, one pass of `BENCH_PROFILE_PROMPTS` prompts profiled."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=model_dir, load_format=LOAD_FORMAT, dtype="bfloat16")
    llm.generate(prompt_sets[0], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
    result = _profiled(lambda p: llm.generate(p, SamplingParams(max_tokens=1), use_tqdm=False),
                       prompt_sets[-1])
    return {**result, **_engine_kind(llm)}


def run_layertap_runner_profiled(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    """The hooked runner, engine core in this process, one pass of `BENCH_PROFILE_PROMPTS` prompts profiled."""
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    runner = VllmRunner(EngineOptions(model=model_dir, dtype="bfloat16", load_format=LOAD_FORMAT, engine_process=False))
    layers = list(range(runner.num_layers + 1))
    runner.reserve_host_buffers(BATCH, len(layers), IN_FLIGHT)

    def run(prompts):
        _in_batches(runner, prompts, layers)

    run(prompt_sets[0])  # warm-up
    # The engine's own thread steps it: the profiler is started and stopped there, between steps.
    result = _profiled(run, prompt_sets[-1], runner._in_engine_thread)
    return {**result, **_engine_kind(runner.llm)}


def run_vllm_extract_hidden_states(model_dir: str, prompt_sets: list[list[str]]) -> dict:
    prompts = prompt_sets[-1]  # one pass, on a fresh engine
    from vllm import LLM, SamplingParams
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as conn

    shm = tempfile.mkdtemp(prefix="hs-", dir="/dev/shm")
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir, load_format=LOAD_FORMAT, dtype="bfloat16", enable_chunked_prefill=False,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {
                                "eagle_aux_hidden_state_layer_ids": list(range(LLAMA2_7B["num_hidden_layers"]))}}},
        kv_transfer_config=KVTransferConfig(kv_connector="ExampleHiddenStatesConnector", kv_role="kv_producer",
                                            kv_connector_extra_config={"shared_storage_path": shm}),
    )
    startup = time.perf_counter() - t0
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    generated = time.perf_counter() - start
    vectors = []
    for output in outputs:
        path = output.kv_transfer_params["hidden_states_path"]
        vectors.append(conn.load_hidden_states(path)["hidden_states"][-1].float().tolist())
        conn.cleanup_hidden_states(path)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generate_s": generated, "read_back_s": seconds - generated,
            "startup_s": startup, "layers_captured": len(vectors[0]) if vectors else 0}


def _cold_caches() -> None:
    """Empty compile caches for this mode's engine (vLLM's, Inductor's, Triton's): a cold start."""
    fresh = Path(tempfile.mkdtemp(prefix="layertap-bench-cold-"))
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[name] = str(fresh / name.lower())


def _compile_cache_state(mode: str) -> str:
    """"cold" when the compile cache this mode's engine reads holds nothing yet, else "warm" (layertap's
    engines keep theirs apart from vLLM's: `vllm_seam`)."""
    from layertap.runner.vllm_seam import compile_cache_root

    default = compile_cache_root() if mode.startswith("layertap") else Path.home() / ".cache" / "vllm"
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or default) / "torch_compile_cache"
    return "warm" if root.is_dir() and any(root.iterdir()) else "cold"


def _finished(result: dict, prompts: list[str]) -> dict:
    result["prompts"] = len(prompts)
    result["switch_interval_s"] = sys.getswitchinterval()
    if "layertap.parts.writer" in sys.modules:
        result["encoder_threads"] = sys.modules["layertap.parts.writer"].encoder_threads()
        result["arrow_memory_pool"] = sys.modules["pyarrow"].default_memory_pool().backend_name
    result["tokens"] = sum(len(p.encode()) + 1 for p in prompts)  # byte-level tokenizer + BOS
    if result["status"] == "ok":
        result["prompts_per_s"] = result["prompts"] / result["seconds"]
        result["tokens_per_s"] = result["tokens"] / result["seconds"]
        if "seconds_with_read_back" in result:
            result["prompts_per_s_with_read_back"] = result["prompts"] / result["seconds_with_read_back"]
    return result


def _failure(exc: BaseException) -> dict:
    import traceback

    return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


def worker(mode: str, workloads: str, model_dir: str, out: str) -> None:
    """Run `mode` on each of `workloads` (comma-separated); a session mode starts its engine once for all of
    them. Writes {workload: result}, rewritten after each workload (kept if a later one runs out of time)."""
    if mode in os.environ.get("BENCH_COLD_MODES", "").split(","):
        _cold_caches()
    compile_cache = _compile_cache_state(mode)
    if os.environ.get("BENCH_SWITCH_INTERVAL"):  # seconds; Python's default is 0.005 (bench/task_overhead.py)
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    if os.environ.get("BENCH_ENCODER_THREADS"):  # Parquet encoders of the flow's process (default: one per core)
        import layertap.parts.writer

        layertap.parts.writer.encoder_threads = lambda: int(os.environ["BENCH_ENCODER_THREADS"])
    if os.environ.get("BENCH_BACKGROUND_NICE"):  # the nice value part writers run at (0: the process's own)
        import layertap.parts.background

        layertap.parts.background.BACKGROUND_NICE = int(os.environ["BENCH_BACKGROUND_NICE"])
    results: dict[str, dict] = {}
    session = None
    if mode in SESSION_MODES:
        try:
            session = globals()[f"session_{mode}"](model_dir)
        except Exception as exc:  # recorded in the results, the other modes still run
            session = _failure(exc)
    for workload in workloads.split(","):
        # Some modes are measured on a prefix of the workload (profiled ones: `BENCH_PROFILE_PROMPTS`).
        limit = PROFILE_PROMPTS if mode in PROFILED_MODES else SUBSET.get(mode, {}).get(workload)
        if os.environ.get("BENCH_MAX_PROMPTS"):  # a dry run of the modes on a CPU
            limit = min(limit or 10**9, int(os.environ["BENCH_MAX_PROMPTS"]))
        prompt_sets = [make_prompts(workload, variant)[:limit] for variant in range(PASSES)]
        try:
            if isinstance(session, dict):
                result = dict(session)
            elif session is not None:
                started, measure = session
                result = {**started, **measure(prompt_sets), "status": "ok"}
            elif mode in ("hf_loop", "hf_batched"):
                result = {**run_hf(model_dir, prompt_sets[-1], batched=mode == "hf_batched"), "status": "ok"}
            else:
                result = {**globals()[f"run_{mode}"](model_dir, prompt_sets), "status": "ok"}
        except Exception as exc:  # recorded in the results, the other workloads still run
            result = _failure(exc)
        results[workload] = {**_finished(result, prompt_sets[-1]), "compile_cache": compile_cache}
        Path(out).write_text(json.dumps(results, indent=1, default=str))


def build_random_weights_dir(path: Path) -> str:
    """The Llama-2-7B shape with random weights (Hugging Face's own initialisation, bfloat16) saved with
    `save_pretrained`, so engines load real files and the parity sample has a reference. Built once per
    path (13.5 GB), on the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from layertap.model.tiny_model import _byte_level_tokenizer

    if (path / "model.safetensors.index.json").is_file():
        return str(path)
    config = LlamaConfig(**LLAMA2_7B, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    building = path.with_name(path.name + ".building")
    model = model.to("cpu")
    torch.cuda.empty_cache()  # the modes' engines need the whole device
    model.save_pretrained(building, max_shard_size="5GB")
    _byte_level_tokenizer().save_pretrained(building)
    os.replace(building, path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workloads", default="short,medium")
    parser.add_argument("--mode-timeout", type=float, default=900,
                        help="seconds one mode may run (a session mode: on all its workloads)")
    parser.add_argument("--tag", default="", help="suffix of the results file name")
    parser.add_argument("--model-dir", help="use this model folder instead of the Llama-2-7B shape (a dry run of "
                        "the modes on a small model, on a CPU too, before spending GPU time)")
    parser.add_argument("--weights", choices=("dummy", "random"), default="dummy",
                        help="dummy: vLLM draws the weights at load; random: a saved random-weight model, loaded "
                             "for real (built once under --weights-dir)")
    parser.add_argument("--weights-dir", default=os.path.join(tempfile.gettempdir(), "layertap-llama2-7b-random"))
    parser.add_argument("--logs", help="folder to keep each mode's output in (vLLM logs its start-up phases there)")
    parser.add_argument("--worker", nargs=4, metavar=("MODE", "WORKLOADS", "MODEL_DIR", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    import torch
    import vllm

    root = Path(tempfile.mkdtemp(prefix="layertap-gpu-bench-"))
    if args.weights == "random":
        os.environ["BENCH_LOAD_FORMAT"] = "auto"  # read by each mode's process
        built = time.perf_counter()
        model_dir = args.model_dir or build_random_weights_dir(Path(args.weights_dir))
        build_s = time.perf_counter() - built
    else:
        model_dir, build_s = args.model_dir or build_model_dir(root), None
    load_format = os.environ.get("BENCH_LOAD_FORMAT", "dummy")
    from cpu_stages import machine  # imported here: the modes' own processes never load the store's code

    report = {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # The host's CPU: the flow's host work (Parquet encoding, the engine's frontend) runs on it, plain
        # generate's hardly, so flow ratios from hosts with other CPUs differ for that reason too.
        "machine": machine(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "commit": os.environ.get("BENCH_COMMIT"),
        "command": "python " + " ".join(sys.argv),
        "model": ({"shape": "Llama-2-7B", **LLAMA2_7B} if not args.model_dir else {"dir": args.model_dir})
                 | {"dtype": "bfloat16", "weights": "saved random weights" if load_format == "auto" else "dummy",
                    "built_in_s": build_s},
        "layers": "all hidden states (33 for the 7B shape)", "pooling": "last", "passes_per_vllm_mode": PASSES,
        "batch_size": BATCH, "batches_in_flight": IN_FLIGHT,
        "cold_modes": os.environ.get("BENCH_COLD_MODES", ""),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"gpu-extract-{report['date']}{'-' + args.tag if args.tag else ''}.json"
    workloads = args.workloads.split(",")
    for workload in workloads:
        report[workload] = {"modes": {}}
    for mode in args.modes.split(","):
        # A session mode runs every workload on one engine; any other mode gets a process per workload.
        for group in [workloads] if mode in SESSION_MODES else [[w] for w in workloads]:
            result_file = root / f"{mode}-{group[0]}.json"
            started = time.perf_counter()
            # Its own process group, so a mode that runs out of time takes its engine processes with it
            # (an engine left behind would hold the GPU's memory and fail every later mode).
            env = dict(os.environ)
            if env.get("BENCH_GC_TRACE") or env.get("BENCH_POOL_MASK"):  # every process of the mode: see there
                if env.get("BENCH_GC_TRACE"):  # logs its long garbage-collector passes
                    Path(env["BENCH_GC_TRACE"]).mkdir(parents=True, exist_ok=True)
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent / "gc_trace"),
                                                                  env.get("PYTHONPATH")]))
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", mode, ",".join(group), model_dir, str(result_file)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
            try:
                stdout, stderr = proc.communicate(timeout=args.mode_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                (Path(args.logs) / f"{mode}-{group[0]}.log").write_text(stdout + stderr)
            found = json.loads(result_file.read_text()) if result_file.exists() else {}
            for workload in group:
                if workload in found:
                    result = found[workload]
                elif proc.returncode == -signal.SIGKILL:
                    result = {"status": "timed out", "limit_s": args.mode_timeout, "stderr": stderr[-3000:]}
                else:
                    result = {"status": "crashed", "returncode": proc.returncode, "stderr": stderr[-3000:]}
                result["mode_wall_s"] = time.perf_counter() - started
                report[workload]["modes"][mode] = result
                print(f"{workload:9s} {mode:28s} {result.get('prompts_per_s', float('nan')):10.1f} prompts/s "
                      f"({result['status']})", flush=True)
            target.write_text(json.dumps(report, indent=1, default=str))  # kept if a later mode runs out of time
    for workload in workloads:
        per_mode = report[workload]["modes"]
        rates = {m: r.get("prompts_per_s") for m, r in per_mode.items()}
        entry = {"prompts_per_s": rates, "modes": per_mode}
        for ours in ("layertap", "layertap_runner", "layertap_float16"):
            if rates.get(ours) and rates.get("vllm_plain"):
                entry.setdefault("ratio_vs_vllm_plain", {})[ours] = rates[ours] / rates["vllm_plain"]
        for name, ref in (("hf_loop", "ratio_vs_hf_loop"), ("hf_batched", "ratio_vs_hf_batched"),
                          ("vllm_extract_hidden_states", "ratio_vs_vllm_extract_hidden_states")):
            entry[ref] = rates["layertap"] / rates[name] if rates.get("layertap") and rates.get(name) else None
        report[workload] = entry
    target.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({w: {k: report[w][k] for k in report[w] if k != "modes"} for w in workloads}, indent=1))
    print("wrote", target)


if __name__ == "__main__":
    main()
