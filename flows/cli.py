"""`layertap run | add | status | export | validate | serve | demo`.

The run options' flags are read off the options model (`layertap.settings.Settings`), so every option has
one, with the model's name, help and checks. Every option can also come from a LAYERTAP_<NAME> environment
variable or a `.env` file (CLI > environment > .env > default). Prefect and the flows are imported inside the commands only, so
`import layertap` and `layertap --help` stay light. Failures end with one line on stderr,
`layertap: error: <reason>`, and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import layertap
from layertap.events import ROWS_ADDED
from layertap.settings import EXTRACTION_OPTIONS, Settings

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_QUARANTINED = 3  # the run finished, but some batches kept failing and were set aside
EXIT_INTERRUPTED = 130

PREFECT_FILE = Path(__file__).resolve().parents[1] / "prefect.yaml"
SAMPLE_DATA = Path(layertap.__file__).resolve().parent / "data" / "sample.csv"
DEMO_STORE = "./layertap-demo"


class UsageError(Exception):
    """A command line argparse rejected; reported as one line like every other error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def _is_flag(annotation: Any) -> bool:
    """A yes/no option (`bool`, or `bool | None` where None lets the runner choose): --NAME / --no-NAME."""
    return annotation is bool or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and set(typing.get_args(annotation)) == {bool, type(None)}
    )


def option_flags(p: argparse.ArgumentParser, names: Iterable[str], **changed: dict) -> None:
    """One flag per run option, read off the options model (`layertap.settings.Settings`): its name, help and
    metavar. Defaults are None so env vars and .env can fill what the command line leaves out; `changed`
    adjusts one option's flag for one command (a required --input, demo's own store)."""
    for name in names:
        field = Settings.model_fields[name]
        kwargs: dict[str, Any] = {"default": None, "help": field.description}
        if _is_flag(field.annotation):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = field.json_schema_extra["metavar"]
            if typing.get_origin(field.annotation) is list:
                kwargs.update(nargs="+", action="extend")
        kwargs.update(changed.get(name, {}))
        p.add_argument(option_flag(name), **kwargs)


def option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def run_option_names() -> list[str]:
    """Every run option but the input files and the store, which each command places itself."""
    return [name for name in Settings.model_fields if name not in ("input", "store")]


def _common_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `demo`, after the run options."""
    p.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")


def _progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="draw a progress bar on stderr while extracting: prompts done, rate, time left (default: when "
             "stderr is a terminal)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="layertap",
        description="Per-layer hidden-state embeddings of a decoder LLM, stored as Parquet + DuckDB.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    epilog = (
        "Every option can also be set as an environment variable LAYERTAP_<NAME> (e.g. LAYERTAP_BATCH_SIZE=256, "
        "LAYERTAP_INPUT=a.csv,b.csv) or in a .env file; the command line wins over the environment, which wins "
        "over .env."
    )

    run = sub.add_parser("run", help="embed the text column of input files into a store", epilog=epilog)
    option_flags(run, ["input", "store"])
    run.add_argument(
        "--dataset", metavar="NAME",
        help="embed what is new in this registered dataset (its files and settings come from the store)",
    )
    option_flags(run, run_option_names())
    _common_options(run)
    _progress_option(run)
    run.set_defaults(func=cmd_run)

    add = sub.add_parser(
        "add",
        help="add input files to a named dataset and announce the new rows",
        description=(
            "Register files under a dataset name in the store, read their rows, and emit the "
            f"'{ROWS_ADDED}' event to the Prefect server in PREFECT_API_URL, which triggers the "
            "embed-new-rows deployment for this dataset. The first add fixes the dataset's text column, "
            "model, layers, pooling, dtype and normalisation; later adds reuse them."
        ),
        epilog=epilog,
    )
    add.add_argument("--dataset", metavar="NAME", required=True, help="dataset name (a-z, 0-9, '.', '_', '-')")
    option_flags(add, ["input", "store", "text_column", *EXTRACTION_OPTIONS], input={
        "required": True, "help": "CSV/TSV/Parquet/JSONL files or globs to add (a file added again is re-read)"})
    add.add_argument("--event", action=argparse.BooleanOptionalAction, default=True,
                     help="emit the rows-added event (default: on; needs PREFECT_API_URL)")
    add.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    add.add_argument("--json", action="store_true", help="print what was added as JSON")
    add.set_defaults(func=cmd_add)

    status = sub.add_parser("status", help="datasets, counts and the last runs of a store")
    option_flags(status, ["store"])
    status.add_argument("--runs", metavar="N", type=int, default=5, help="how many recent runs to show (default: 5)")
    option_flags(status, ["engine_dir"])
    status.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.set_defaults(func=cmd_status)

    export = sub.add_parser(
        "export", help="write one layer (or all) to Parquet or .npy files",
        description=(
            "Parquet: layer_<L>.parquet (prompt_hash, text, embedding). npy: layer_<L>.npy, a prompts x "
            "dimension float array, with layer_<L>.csv giving each row's prompt_hash and text."
        ),
    )
    option_flags(export, ["store"])
    export.add_argument("--layer", metavar="L|all", default="all",
                        help="layer index (negative counts from the end) or 'all' (default: all)")
    export.add_argument("--format", choices=("parquet", "npy"), default="parquet", help="file format (default: parquet)")
    export.add_argument("--output", metavar="DIR", required=True, help="folder to write into (created if missing)")
    export.add_argument("--model", metavar="DIR|FINGERPRINT", help="pick the extraction when the store holds several")
    export.add_argument("--pooling", metavar="last|mean", help="pick the extraction by pooling")
    export.add_argument("--dtype", metavar="DTYPE", help="pick the extraction by engine dtype")
    export.add_argument("--store-dtype", metavar="float32|float16", help="pick the extraction by stored dtype")
    export.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    export.set_defaults(func=cmd_export)

    validate = sub.add_parser(
        "validate", help="re-check every published part of a store (files, prompts, layers, finite vectors)"
    )
    option_flags(validate, ["store"])
    validate.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    validate.set_defaults(func=cmd_validate)

    serve = sub.add_parser(
        "serve",
        help="serve the embed, embed-new-rows and embed-nightly deployments from this process",
        description=(
            "Registers the three deployments of prefect.yaml with the Prefect server in PREFECT_API_URL and "
            "runs their flow runs in this process, without a work pool or worker. Their runs share warm "
            "engines, which stop after their idle timeout and when serve stops. Stop with Ctrl-C."
        ),
    )
    serve.add_argument("--prefect-file", metavar="PATH", default=str(PREFECT_FILE),
                       help=f"deployments to serve (default: {PREFECT_FILE})")
    serve.add_argument("--start-engine", action="store_true",
                       help="start the warm engine for the environment's settings (LAYERTAP_MODEL, engine options) "
                            "now, so the first triggered run finds it up")
    serve.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo", help="build the tiny model, embed the shipped sample and show how to read it", epilog=epilog
    )
    option_flags(demo, ["store", *run_option_names()], store={
        "default": DEMO_STORE,
        "help": f"store folder (default: {DEMO_STORE}; LAYERTAP_STORE is not used, so the demo never mixes into it)"})
    _common_options(demo)
    _progress_option(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


def settings_from_args(args: argparse.Namespace, **forced: Any):
    """CLI values on top of env and .env; an option not given on the command line is left to them."""
    from layertap.settings import load_settings

    given = {name: getattr(args, name, None) for name in Settings.model_fields}
    given.update(forced)
    return load_settings(env_file=_env_file(args), **given)


def preflight(settings):
    """Cheap checks before Prefect starts, so common mistakes fail fast with one clear line; returns the run
    prepared against its model (None for the demo model before it is built)."""
    from layertap.errors import InputError

    if not settings.input:
        raise InputError("input: no input files given (--input or LAYERTAP_INPUT)")
    for pattern in settings.input:
        path = os.path.expanduser(pattern)
        if not os.path.exists(path) and not glob.glob(path, recursive=True):
            raise InputError(f"input: no file matches {pattern}")
    from layertap.preflight import check_run

    return check_run(settings)


def run_flow(settings) -> dict:
    """Run the embed flow in this process with fully resolved settings. A given model's engine starts first,
    in the background, so it comes up while Prefect starts (its temporary server, when no API is set) and
    the flow reads and plans; the flow then finds it started."""
    from flows.embed import embed_flow

    if settings.model:
        from flows.pipeline import run_settings
        from layertap.runner import engine_cache

        engine_cache.start_early(run_settings(settings, deployed=False))
    params = settings.model_dump()
    return embed_flow(**params, env_file=None)


def _print_summary(summary: dict, title: str) -> None:
    ledger = summary.get("ledger") or {}
    layers = summary["layers"]
    print(
        f"{title}: {summary['rows']} rows ({summary['new_rows']} new): {summary['new_prompts']} new prompts, "
        f"{summary['duplicates']} duplicates, {summary['rejected']} rejected"
    )
    if summary["planned"]:
        refused = f", {summary['refused']} refused by the engine" if summary.get("refused") else ""
        print(
            f"  extracted  {summary['embedded']} of {summary['planned']} planned prompts{refused} "
            f"in {summary['seconds']:.1f}s"
        )
    else:
        print(f"  extracted  nothing: {ledger.get('embedded', 0)} prompts already embedded")
    print(f"  layers     {','.join(map(str, layers))} ({len(layers)} layers), dimension {summary['dimension']}")
    print(f"  model      {summary['model']}")
    print(f"  store      {summary['store']} (extraction {summary['extraction_id']})")
    for held in summary.get("quarantined") or []:
        print(f"  quarantined batch {held['batch_id']} ({held['prompts']} prompts): {held['error']}")
    if ledger:
        statuses = ("embedded", "duplicate", "rejected", "quarantined", "pending")
        print("  ledger     " + ", ".join(f"{s} {ledger[s]}" for s in statuses if s in ledger and (ledger[s] or s != "quarantined")))


def _progress_bar(args: argparse.Namespace):
    """A bar on stderr (prompts done, rate, time left) when asked for, or by default when stderr is a
    terminal; else a no-op context."""
    import contextlib

    wanted = args.progress if args.progress is not None else sys.stderr.isatty()
    if not wanted:
        return contextlib.nullcontext()
    from layertap.terminal_progress import terminal_progress

    return terminal_progress()


# Settings a dataset fixes when it is created; `run --dataset` may not change them.
_DATASET_FIXED = ("input", "text_column", *EXTRACTION_OPTIONS)


def _dataset_options(args: argparse.Namespace) -> dict:
    """`run --dataset`'s run options (those given here); the dataset's own come from the store."""
    from layertap.errors import InputError

    fixed = [option_flag(name) for name in _DATASET_FIXED if getattr(args, name, None) is not None]
    if fixed:
        raise InputError(f"{', '.join(fixed)}: set by dataset {args.dataset} when it was first added")
    options = {name: getattr(args, name) for name in run_option_names() if name not in _DATASET_FIXED}
    return {k: v for k, v in options.items() if v is not None}


def cmd_run(args: argparse.Namespace) -> int:
    from layertap.store.registry import dataset_settings
    from layertap.store.up_to_date import finish_if_up_to_date

    prepared = None
    if args.dataset:
        options = _dataset_options(args)
        store = str(settings_from_args(args).store_path())
        settings = dataset_settings(args.dataset, store, _env_file(args), options)
    else:
        settings = settings_from_args(args)
        prepared = preflight(settings)
    # Nothing new: answered from the store, without Prefect, torch or an engine.
    summary = finish_if_up_to_date(settings, args.dataset, prepared)
    if summary is None:
        from layertap.runner.engine_cache import check_executor

        check_executor(settings)  # a Ray cluster too small for the engines asked for fails here, before Prefect
        with _progress_bar(args):
            if args.dataset:
                from flows.embed_dataset import embed_dataset_flow

                summary = embed_dataset_flow(args.dataset, store, _env_file(args), options)
            else:
                summary = run_flow(settings)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_summary(summary, f"layertap run (dataset {args.dataset})" if args.dataset else "layertap run")
    return EXIT_QUARANTINED if summary.get("quarantined") else EXIT_OK


def _env_file(args: argparse.Namespace) -> str | None:
    env_file = args.env_file if args.env_file and Path(args.env_file).is_file() else None
    if args.env_file and args.env_file != ".env" and env_file is None:
        raise FileNotFoundError(f"env file {args.env_file} does not exist")
    return env_file


def _store_dir(args: argparse.Namespace) -> Path:
    from layertap.settings import load_settings

    return load_settings(env_file=_env_file(args), store=args.store).store_path()


def send_rows_added(dataset: str, store: str, files: list[str]) -> str:
    """Emit the rows-added event to the configured Prefect server; returns the event id."""
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    from layertap import events

    url = PREFECT_API_URL.value()
    if not url:
        raise RuntimeError("PREFECT_API_URL is not set")
    with get_client(sync_client=True) as client:
        problem = client.api_healthcheck()
    if problem is not None:
        raise RuntimeError(f"Prefect server at {url} is not reachable ({problem})")
    sent = emit_event(
        events.ROWS_ADDED, resource=events.resource(dataset, store),
        payload=events.payload(dataset, store, files),
    )
    EventsWorker.drain_all(timeout=30)
    if sent is None:
        raise RuntimeError("Prefect did not emit the event")
    return str(sent.id)


def cmd_add(args: argparse.Namespace) -> int:
    from layertap.store.registry import Registry
    from layertap.settings import load_settings

    given_names = ("text_column", *EXTRACTION_OPTIONS)
    settings = load_settings(
        env_file=_env_file(args), store=args.store, **{name: getattr(args, name) for name in given_names}
    )
    options = {name: getattr(settings, name) for name in EXTRACTION_OPTIONS}
    if options["model"]:
        options["model"] = str(Path(options["model"]).expanduser().resolve())
    given = {name for name in given_names if getattr(args, name) is not None}
    store = str(settings.store_path())
    added = Registry(store).add_files(args.dataset, list(args.input), settings.text_column, options, given)
    result = {
        "dataset": args.dataset, "store": store, "created": added.created, "files": added.files,
        "new_files": added.new_files, "dataset_files": len(added.dataset.sources), "event": None,
    }
    note = None
    if args.event:
        try:
            result["event"] = send_rows_added(args.dataset, store, added.files)
        except RuntimeError as exc:
            note = (f"no {ROWS_ADDED} event sent: {exc}; embed now with "
                    f"`layertap run --dataset {args.dataset} --store {store}`")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        verb = "created" if added.created else "added to"
        print(f"layertap add: {verb} dataset {args.dataset}: {len(added.files)} files given, "
              f"{len(added.new_files)} new to it ({len(added.dataset.sources)} files in the dataset)")
        print(f"  store      {store}")
        if result["event"]:
            print(f"  event      {ROWS_ADDED} {result['event']}")
    if note:
        print(f"layertap: note: {note}", file=sys.stderr)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from layertap.store.registry import read_status
    from layertap.runner.warm_engine import list_engines
    from layertap.settings import load_settings

    status = read_status(_store_dir(args), last_runs=args.runs)
    status["engines"] = list_engines(load_settings(env_file=_env_file(args), engine_dir=args.engine_dir).engine_dir)
    if args.json:
        print(json.dumps(status, indent=2, default=str))
        return EXIT_OK
    print(f"store {status['store']}: {status['files']} files, {status['rows']} rows, {status['prompts']} prompts")
    print(f"datasets ({len(status['datasets'])})")
    for d in status["datasets"]:
        opts = d["options"]
        unread = f" ({d['files'] - d['files_read']} not read yet)" if d["files"] > d["files_read"] else ""
        print(f"  {d['name']:<20} {d['files']:>3} files{unread} {d['rows']:>9} rows   layers {opts.get('layers')}, "
              f"{opts.get('pooling')}, {opts.get('dtype')}, model {opts.get('model') or 'tiny demo model'}")
    print(f"extractions ({len(status['extractions'])})")
    for e in status["extractions"]:
        layers = ",".join(map(str, e["layers"])) or "none yet"
        print(f"  {e['extraction_id']}  {e['prompts']:>9} prompts  layers {layers}  {e['pooling']}, {e['dtype']}, "
              f"{e['model']}")
    _print_engines(status["engines"])
    print(f"last runs ({len(status['runs'])})")
    for r in status["runs"]:
        s = r["summary"]
        what = r["dataset"] and f"dataset {r['dataset']}" or "inputs"
        if r["status"] == "completed":
            detail = (f"{s.get('new_rows', 0)} new rows, {s.get('embedded', 0)} embedded, "
                      f"{s.get('skipped', 0)} skipped, {s.get('ledger', {}).get('rejected', 0)} rejected")
        else:
            detail = s.get("error", "")
        seconds = f"{r['seconds']:.1f}s" if r["seconds"] is not None else "-"
        print(f"  {str(r['started_at'])[:19]}  {r['status']:<9} {what:<24} {detail}  {seconds}")
    return EXIT_OK


def _print_engines(engines: list[dict]) -> None:
    import time

    print(f"warm engines ({len(engines)})")
    now = time.time()
    for e in engines:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["started_at"]))
        use = (f"{e['clients']} runs attached" if e.get("clients") else
               f"idle {now - e['last_used']:.0f} s of {e['idle_timeout']:.0f} s")
        device = f", device {e['device_bytes'] / 2**30:.1f} GiB" if e.get("device_bytes") is not None else ""
        print(f"  {e['key']}  pid {e['pid']}  {e['model']} ({e['options']['dtype']})  since {since}  {use}  "
              f"host {e['host_rss_bytes'] / 2**30:.1f} GiB{device}")


def cmd_export(args: argparse.Namespace) -> int:
    from layertap.store.export import export_layers
    from layertap.errors import InputError

    if args.layer == "all":
        layers: Any = "all"
    else:
        try:
            layers = [int(part) for part in args.layer.split(",")]
        except ValueError:
            raise InputError(f"--layer {args.layer!r}: expected 'all' or layer indices like 4 or 0,-1") from None
    written = export_layers(_store_dir(args), args.output, layers, args.format,
                            model=args.model, pooling=args.pooling, dtype=args.dtype, store_dtype=args.store_dtype)
    for path in written:
        print(path)
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from layertap.store.check import check_store

    report = check_store(_store_dir(args))
    for problem in report.problems:
        print(f"  {problem}")
    if not report.ok:
        raise RuntimeError(f"{report.store}: {len(report.problems)} of {report.parts} parts failed the checks")
    print(f"layertap validate: {report.store}: {report.parts} parts, {report.vectors} vectors, all checks passed")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    import threading

    from flows.serve import serve_from_prefect_file
    from layertap.runner import warm_engine
    from layertap.settings import load_settings

    settings = load_settings(env_file=_env_file(args))
    if args.start_engine:
        threading.Thread(target=_start_warm_engine, args=(settings,), name="layertap-warm-engine", daemon=True).start()
    try:
        serve_from_prefect_file(args.prefect_file)
    finally:
        stopped = warm_engine.stop_engines(settings.engine_dir)
        if stopped:
            print(f"layertap serve: stopped {stopped} warm engines", file=sys.stderr)
    return EXIT_OK


def _start_warm_engine(settings) -> None:
    """Start the warm engine `settings` would attach to, and detach: it stays up for the runs to come."""
    from flows.pipeline import resolve_model
    from layertap.runner import engine_cache

    try:
        settings = settings.model_copy(update={"model": resolve_model(settings), "warm_engine": True})
        engine_cache.start_runner(*engine_cache.engine_start_args(settings)).close()
    except Exception as exc:  # noqa: BLE001 - runs still start one on first use
        print(f"layertap serve: the warm engine did not start: {_one_line(exc)}", file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    from layertap.store.up_to_date import finish_if_up_to_date

    settings = settings_from_args(args, input=[str(SAMPLE_DATA)], text_column="text")
    summary = finish_if_up_to_date(settings, run=preflight(settings))  # a rerun of the demo: from the store
    if summary is None:
        with _progress_bar(args):
            summary = run_flow(settings)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return EXIT_OK
    _print_summary(summary, "layertap demo")
    print(f"  input      {SAMPLE_DATA}")
    print()
    print("Query it from Python:")
    print("    from layertap import Store")
    print(f"    table = Store({summary['store']!r}).embeddings(layer={summary['layers'][-1]})")
    print("    print(table.num_rows, table.schema)")
    return EXIT_OK


def _one_line(exc: BaseException) -> str:
    from pydantic import ValidationError

    from layertap.settings import settings_error_line

    if isinstance(exc, ValidationError):
        text = settings_error_line(exc)
    elif isinstance(exc, FileNotFoundError) and exc.filename:
        text = f"{exc.strerror or 'not found'}: {exc.filename}"
    else:
        from layertap.errors import LayertapError

        text = str(exc) or type(exc).__name__
        if not isinstance(exc, (LayertapError, OSError, UsageError)):
            text = f"{type(exc).__name__}: {text}"
    return " ".join(text.split())


def _environment_defaults() -> None:
    """Defaults for the libraries underneath; a variable the user set always wins.

    stdout carries the result (and --json must parse), so the engine logs to stderr, warnings only.
    Without a Prefect server, Prefect starts a temporary one, which needs more than its default 20 s on a
    busy or small machine.
    """
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # The temporary local API has no one to report usage to; without this it logs a network error.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `layertap` command; returns the exit code."""
    _environment_defaults()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"layertap: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("layertap: error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and a non-zero exit
        from pydantic import ValidationError

        print(f"layertap: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValidationError) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
