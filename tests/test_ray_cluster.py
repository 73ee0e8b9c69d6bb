"""`layertap run` against an existing Ray cluster (`ray start --head` on this machine, 2 CPUs), reached by its
address, as a user runs it: a real subprocess, real engines that are actors of that cluster.

Killing the run kills its engines (they belong to the run's process) and leaves the cluster up; the rerun
re-extracts nothing that was published; asking for more engines than the cluster holds fails at once. The
engine's runner runs in a process of its own inside the actor, as it does on a GPU. The engines run eagerly:
compiling adds seconds to each start and nothing to what is checked here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import pytest

pytest.importorskip("ray")

from bench.incremental import free_port, write_csv  # noqa: E402

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
TEXTS = [f"cluster prompt {i}: a lantern {i % 17} over the harbour {i * 5 % 23}" for i in range(256)]


def child_env(**extra: str) -> dict:
    """This environment without LAYERTAP_* or RAY_* variables, with the checkout importable; clients of the
    cluster send its token (Ray's clusters start with token authentication on)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAYERTAP_", "RAY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAY_AUTH_MODE"] = "token"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def cluster():
    """`ray start --head --block` with 2 CPUs in a temporary folder of its own; stopped (its process group)
    at the module's end, never `ray stop`, which would stop every cluster of this machine."""
    temp = tempfile.mkdtemp(prefix="lt-ray-", dir="/tmp")
    port = free_port()
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
         f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"],
        env=child_env(LT_TEST_RAY_HEAD=temp), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([RAY, "status", f"--address={address}"], env=child_env(),
                             capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, (Path(temp) / "head.log").read_text()
            time.sleep(1)
        yield address, head
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        for pid in marked(temp):  # the cluster's processes outside the head's group (its workers)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def marked(marker: str) -> dict[int, str]:
    """Processes of this user whose environment or command line mentions `marker`: pid -> command line."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ or marker.encode() in cmdline:
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
    return found


def layertap(address: str, folder: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`layertap run` in a session of its own, its output in files of `folder` (a temporary Prefect server that
    a killed run leaves behind would hold pipes open)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", *args],
                                env=child_env(RAY_ADDRESS=address, **(env or {})), cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=stdout, stderr=stderr, start_new_session=True)


def finish(run: subprocess.Popen, folder: Path, timeout: float = 600) -> tuple[int, str, str]:
    """The run's exit code and output, once it ended; what is left of its session (the temporary Prefect server
    of a killed run, never an engine: those are the cluster's processes) is killed."""
    try:
        run.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    return run.returncode, (folder / "stdout").read_text(), (folder / "stderr").read_text()


def parts(store: Path) -> list[tuple[str, int]]:
    with duckdb.connect(str(store / "layertap.duckdb"), read_only=True) as con:
        return con.execute("SELECT path, num_prompts FROM parts ORDER BY path").fetchall()


def snapshot(store: Path) -> dict[str, tuple[int, int]]:
    """Size and modification time of every file of the store but its lock file (which records the last command
    that took the lock: asking whether a run has anything to do takes it)."""
    return {p.relative_to(store).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(store.rglob("*")) if p.is_file() and p.name != "layertap.lock"}


@pytest.mark.timeout(900)
def test_an_existing_cluster_by_address(cluster, tiny_model, tmp_path):
    address, head = cluster
    store = tmp_path / "store"
    source = write_csv(tmp_path / "in.csv", TEXTS)
    args = ["--input", source, "--model", tiny_model, "--store", str(store), "--layers", "0,-1",
            "--batch-size", "32", "--parity-sample", "2", "--runner-process", "--enforce-eager", "--executor", "ray",
            "--engines", "1"]

    # Killed mid-run (the flow's process SIGKILLs itself once its second batch is published, while its engine
    # works on the third): its engine goes with it, while the cluster stays up.
    marker = str(tmp_path / "killed-run")  # in the run's and its engines' environment
    run = layertap(address, tmp_path / "killed", *args, "--batches-in-flight", "1",  # published one by one
                   env={"LAYERTAP_ENGINE_DIR": marker, "LAYERTAP_FAULTS": "publish.committed:kill@2"})
    seen: dict[int, str] = {}
    while run.poll() is None:
        seen.update(marked(marker))
        time.sleep(0.2)
    code, out, err = finish(run, tmp_path / "killed")
    assert code == -signal.SIGKILL, err[-3000:]
    assert any(cmd.startswith("ray::EngineActor") for cmd in seen.values()), seen  # its engine was an actor
    assert any("multiprocessing.spawn" in cmd for cmd in seen.values()), seen  # whose runner had a process
    deadline = time.monotonic() + 60
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not marked(marker), marked(marker)  # no actor, no engine of the killed run is left
    assert head.poll() is None
    before = parts(store)
    assert 2 <= len(before) < 8

    # The rerun re-extracts nothing that was published.
    code, out, err = finish(layertap(address, tmp_path / "rerun", *args, "--json"), tmp_path / "rerun")
    assert code == 0, err[-3000:]
    summary = json.loads(out)
    done = sum(n for _, n in before)
    assert summary["planned"] == summary["embedded"] == len(TEXTS) - done
    after = parts(store)
    assert set(before) < set(after) and sum(n for _, n in after) == len(TEXTS)
    assert subprocess.run([sys.executable, "-m", "flows.cli", "validate", "--store", str(store)],
                          env=child_env(), capture_output=True).returncode == 0
    assert head.poll() is None  # the cluster outlives the runs
    assert subprocess.run([RAY, "status", f"--address={address}"], env=child_env(),
                          capture_output=True).returncode == 0

    # More engines than the cluster holds: one line, at once, and the store as it was (new rows wait).
    write_csv(tmp_path / "more.csv", [f"one more row {i}" for i in range(8)])
    untouched = snapshot(store)
    started = time.monotonic()
    greedy = layertap(address, tmp_path / "greedy", *args[:-1], "3", "--input", str(tmp_path / "more.csv"))
    code, out, err = finish(greedy, tmp_path / "greedy", timeout=120)
    assert time.monotonic() - started < 60
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("layertap: error")]
    assert errors == [err.strip().splitlines()[-1]], err
    assert "engines: 3 engines of 1 CPU do not fit the Ray cluster at" in errors[0] and "2 CPUs" in errors[0]
    assert snapshot(store) == untouched
    assert head.poll() is None
