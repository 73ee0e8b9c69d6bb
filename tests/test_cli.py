"""`layertap run` / `layertap demo`: exit codes, one-line errors, and settings from env and .env.

Successful runs call `main()` in this process so they share one engine; error paths that fail
before any model work also run as a real subprocess to check what a user sees on stderr.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path


from layertap.runner import engine_cache
from flows.cli import main
from layertap.store.registry import read_status

ROOT = Path(__file__).resolve().parents[1]


def write_csv(path: Path, texts: list[str], column: str = "text") -> str:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([column])
        writer.writerows([t] for t in texts)
    return str(path)


def child_env(**extra: str) -> dict:
    """This environment without LAYERTAP_* variables, with the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The real command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, env=child_env(**(env or {})),
        cwd=cwd, timeout=120,
    )


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("layertap: error: "), stderr
    return lines[0][len("layertap: error: ") :]


# --- errors that happen before any model work: real subprocess, exactly one stderr line -----------------


def test_bad_option_value_is_one_line_naming_the_setting(tmp_path):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    out = run_cli("run", "--input", source, "--pooling", "max", cwd=tmp_path)
    assert out.returncode == 2
    reason = one_error_line(out.stderr)
    assert reason.startswith("invalid setting pooling (LAYERTAP_POOLING)")
    assert out.stdout == ""


def test_bad_env_value_is_one_line(tmp_path):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    out = run_cli("run", "--input", source, env={"LAYERTAP_BATCH_SIZE": "lots"}, cwd=tmp_path)
    assert out.returncode == 2
    assert one_error_line(out.stderr).startswith("invalid setting batch_size (LAYERTAP_BATCH_SIZE)")


def test_bad_dotenv_value_is_one_line(tmp_path):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    (tmp_path / ".env").write_text("LAYERTAP_LAYERS=first,last\n")
    out = run_cli("run", "--input", source, cwd=tmp_path)
    assert out.returncode == 2
    assert one_error_line(out.stderr).startswith("invalid setting layers (LAYERTAP_LAYERS)")


def test_unknown_option_is_one_line(tmp_path):
    out = run_cli("run", "--frobnicate", cwd=tmp_path)
    assert out.returncode == 2
    assert "--frobnicate" in one_error_line(out.stderr)


def test_missing_command_is_one_line(tmp_path):
    out = run_cli(cwd=tmp_path)
    assert out.returncode == 2
    one_error_line(out.stderr)


def test_missing_input_file_is_one_line(tmp_path):
    out = run_cli("run", "--input", str(tmp_path / "nope.csv"), cwd=tmp_path)
    assert out.returncode == 1
    assert one_error_line(out.stderr) == f"input: no file matches {tmp_path / 'nope.csv'}"


def test_no_input_at_all_is_one_line(tmp_path):
    out = run_cli("run", cwd=tmp_path)
    assert out.returncode == 1
    assert "no input files given" in one_error_line(out.stderr)


def test_model_folder_without_config_is_one_line(tmp_path):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    (tmp_path / "model").mkdir()
    out = run_cli("run", "--input", source, "--model", str(tmp_path / "model"), cwd=tmp_path)
    assert out.returncode == 1
    assert "has no config.json" in one_error_line(out.stderr)


def test_layer_out_of_range_is_one_line(tmp_path, tiny_model):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    out = run_cli("run", "--input", source, "--model", tiny_model, "--layers", "0,9", cwd=tmp_path)
    assert out.returncode == 1
    assert "index 9 is out of range" in one_error_line(out.stderr)


def test_importing_the_library_and_cli_does_not_import_prefect(tmp_path):
    code = "import sys, layertap, flows.cli, layertap.settings, layertap.runner.engine_cache; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), check=True)
    assert out.stdout.strip() == "False"


def test_help_exits_zero(tmp_path):
    out = run_cli("run", "--help", cwd=tmp_path)
    assert out.returncode == 0
    assert "--input" in out.stdout and "--remove-period" in out.stdout


# --- real runs in this process, sharing one engine ---------------------------------------------------


def test_run_then_rerun(shared_engine, tiny_model, tmp_path, capsys):
    source = write_csv(tmp_path / "in.csv", ["alpha", "beta", "alpha", "", "gamma."])
    store = tmp_path / "store"
    args = ["run", "--input", source, "--model", tiny_model, "--layers", "0,-1", "--store", str(store), "--json"]
    before = set(engine_cache._runners)
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    # The command starts the engine before Prefect, and the flow computes on that one: no engine started
    # by the command sits unused.
    for thread in threading.enumerate():
        if thread.name == engine_cache.START_THREAD:
            thread.join(300)
    assert all(runner.activity().steps > 0 for key, runner in engine_cache._runners.items() if key not in before)
    assert (summary["rows"], summary["embedded"], summary["duplicates"], summary["rejected"]) == (5, 3, 1, 1)
    assert summary["layers"] == [0, 4] and summary["dimension"] == 128
    assert summary["store"] == str(store)

    requests = engine_cache.runner_requests()
    assert main(args[:-1]) == 0
    out = capsys.readouterr().out
    assert "extracted  nothing: 3 prompts already embedded" in out
    assert engine_cache.runner_requests() == requests

    # In a process of its own, as a user runs it: answered from the store, with no Prefect, torch or vLLM
    # loaded, and recorded in the store's history like any run.
    code = ("import json, sys; from flows.cli import main; code = main(sys.argv[1:]); "
            "print(json.dumps([code, sorted(m for m in ('prefect', 'torch', 'vllm') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code, *args[:-1]], capture_output=True, text=True, env=child_env(),
                         cwd=tmp_path, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == [0, []], out.stderr
    assert "extracted  nothing: 3 prompts already embedded" in out.stdout
    runs = read_status(store)["runs"]
    assert [r["status"] for r in runs[:3]] == ["completed"] * 3
    assert runs[0]["flow_run_id"] is None and runs[0]["summary"]["skipped"] == 3
    assert runs[0]["summary"]["ledger"] == summary["ledger"]

    # A changed input is work again: the flow runs and embeds only the new prompt.
    write_csv(tmp_path / "in.csv", ["alpha", "beta", "alpha", "", "gamma.", "delta"])
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["new_rows"], again["embedded"], again["skipped"]) == (6, 1, 3)


def test_env_and_dotenv_settings_reach_the_run(shared_engine, tiny_model, tmp_path, monkeypatch, capsys):
    source = write_csv(tmp_path / "in.csv", ["Hello world.", "Hello world"], column="body")
    (tmp_path / ".env").write_text(
        f"LAYERTAP_INPUT={source}\nLAYERTAP_MODEL={tiny_model}\nLAYERTAP_LAYERS=1\nLAYERTAP_TEXT_COLUMN=wrong\n"
    )
    monkeypatch.setenv("LAYERTAP_TEXT_COLUMN", "body")  # env beats .env
    monkeypatch.setenv("LAYERTAP_REMOVE_PERIOD", "1")
    monkeypatch.setenv("LAYERTAP_STORE", str(tmp_path / "from-env"))
    assert main(["run", "--layers", "1,2", "--json"]) == 0  # the CLI beats both
    summary = json.loads(capsys.readouterr().out)
    assert summary["layers"] == [1, 2]
    assert summary["embedded"] == 1 and summary["duplicates"] == 1  # remove_period merged the two rows
    assert summary["store"] == str(tmp_path / "from-env")


def test_error_inside_the_flow_ends_with_one_line(shared_engine, tiny_model, tmp_path, capsys):
    source = write_csv(tmp_path / "in.csv", ["hello"], column="body")
    code = main(["run", "--input", source, "--model", tiny_model, "--store", str(tmp_path / "s")])
    assert code == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("layertap: error: ") and "text" in last and "in.csv" in last


def test_demo_builds_the_model_and_shows_how_to_query(shared_engine, tiny_model, tmp_path, capsys):
    # The demo builds its model next to the store; put the store beside the shared tiny model so the
    # demo reuses that build (and the shared engine).
    store = Path(tiny_model).parent.parent / "demo-store"
    assert main(["demo", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "layertap demo: 200 rows (200 new): 192 new prompts, 6 duplicates, 2 rejected" in out
    assert "extracted  192 of 192 planned prompts" in out
    assert "dimension 128" in out and "layers     0,1,2,3,4" in out
    assert str(store) in out and tiny_model in out
    snippet = out.split("Query it from Python:\n", 1)[1].strip().splitlines()
    assert len(snippet) == 3 and snippet[0].strip() == "from layertap import Store"

    namespace: dict = {}
    code = "\n".join(line.strip() for line in snippet).replace("print(", "result = (")
    exec(code, namespace)  # the snippet the demo prints really works
    assert namespace["table"].num_rows > 150

    # Run again, as a user would: answered from the store, with no Prefect, torch or vLLM loaded.
    code = ("import json, sys; from flows.cli import main; code = main(sys.argv[1:]); "
            "print(json.dumps([code, sorted(m for m in ('prefect', 'torch', 'vllm') if m in sys.modules)]))")
    again = subprocess.run([sys.executable, "-c", code, "demo", "--store", str(store)], capture_output=True,
                           text=True, env=child_env(), cwd=tmp_path, check=True)
    assert json.loads(again.stdout.splitlines()[-1]) == [0, []], again.stderr
    assert "extracted  nothing: 192 prompts already embedded" in again.stdout


# --- add, status, export, validate, serve -------------------------------------------------------------


def test_every_command_has_help(tmp_path):
    for command in ("run", "add", "status", "export", "validate", "serve", "demo"):
        out = run_cli(command, "--help", cwd=tmp_path)
        assert out.returncode == 0 and "usage: layertap " + command in out.stdout, out.stderr
    assert "rows-added" in run_cli("add", "--help", cwd=tmp_path).stdout


def test_add_without_a_server_registers_and_says_how_to_embed(tmp_path):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    out = run_cli("add", "--dataset", "d1", "--input", source, "--store", str(tmp_path / "s"), "--json",
                  env={"PREFECT_API_URL": ""}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["new_files"] == [source]
    assert "no layertap.dataset.rows-added event sent" in out.stderr and "layertap run --dataset d1" in out.stderr
    status = run_cli("status", "--store", str(tmp_path / "s"), cwd=tmp_path)
    assert status.returncode == 0 and "d1" in status.stdout and "(1 not read yet)" in status.stdout


def test_add_with_an_unreachable_server_still_registers(tmp_path):
    source = write_csv(tmp_path / "in.csv", ["hello"])
    out = run_cli("add", "--dataset", "d1", "--input", source, "--store", str(tmp_path / "s"),
                  env={"PREFECT_API_URL": "http://127.0.0.1:9/api"}, cwd=tmp_path)
    assert out.returncode == 0 and "is not reachable" in out.stderr


def test_run_dataset_status_export_validate(shared_engine, tiny_model, tmp_path, capsys):
    import numpy as np
    import pyarrow.parquet as pq

    from layertap import Store

    store = str(tmp_path / "store")
    source = write_csv(tmp_path / "in.csv", ["alpha", "beta", "alpha", ""])
    assert main(["add", "--dataset", "greek", "--input", source, "--store", store, "--model", tiny_model,
                 "--layers", "0,-1", "--no-event"]) == 0
    capsys.readouterr()
    assert main(["run", "--dataset", "greek", "--store", store, "--parity-sample", "0", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "layertap run (dataset greek): 4 rows (4 new)" in captured.out
    assert re.search(r"embedding .*2/2 prompts 1/1 batches [\d.]+ prompts/s 0:00:00 left", captured.err), captured.err
    assert main(["run", "--dataset", "greek", "--store", store, "--layers", "1"]) == 1
    assert "--layers: set by dataset greek" in capsys.readouterr().err

    assert main(["status", "--store", store]) == 0
    out = capsys.readouterr().out
    assert "greek" in out and "2 prompts  layers 0,4" in out
    assert "completed dataset greek" in out.replace("  ", " ") and "4 new rows, 2 embedded" in out

    assert main(["export", "--store", store, "--layer", "-1", "--format", "npy", "--output", str(tmp_path / "npy")]) == 0
    vectors = np.load(tmp_path / "npy" / "layer_4.npy")
    index = (tmp_path / "npy" / "layer_4.csv").read_text().splitlines()
    expected = Store(store).embeddings(layer=4)
    assert vectors.shape == (2, 128) and index[0] == "row,prompt_hash,text" and len(index) == 3
    np.testing.assert_array_equal(vectors[0], np.asarray(expected["embedding"][0].as_py(), np.float32))
    assert main(["export", "--store", store, "--output", str(tmp_path / "pq")]) == 0
    assert sorted(p.name for p in (tmp_path / "pq").iterdir()) == ["layer_0.parquet", "layer_4.parquet"]
    assert pq.read_table(tmp_path / "pq" / "layer_0.parquet").equals(Store(store).embeddings(layer=0))

    capsys.readouterr()
    assert main(["validate", "--store", store]) == 0
    assert "1 parts, 4 vectors, all checks passed" in capsys.readouterr().out
    (part,) = (Path(store) / "parts").rglob("*.parquet")
    part.write_bytes(b"not parquet")
    assert main(["validate", "--store", store]) == 1
    captured = capsys.readouterr()
    assert "check 'readable'" in captured.out and "1 of 1 parts failed the checks" in captured.err
