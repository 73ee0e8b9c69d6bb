"""`layertap run` and `layertap demo`.

Every option can also come from a LAYERTAP_<NAME> environment variable or a `.env` file
(CLI > environment > .env > default). Prefect and the flows are imported inside the commands only, so
`import layertap` and `layertap --help` stay light. Failures end with one line on stderr,
`layertap: error: <reason>`, and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_QUARANTINED = 3  # the run finished, but some batches kept failing and were set aside
EXIT_INTERRUPTED = 130

SAMPLE_DATA = Path(__file__).resolve().parent / "data" / "sample.csv"
DEMO_STORE = "./layertap-demo"


class UsageError(Exception):
    """A command line argparse rejected; reported as one line like every other error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def _engine_options(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `demo`. Defaults are None so env vars and .env can fill them."""
    p.add_argument("--model", metavar="DIR", help="Hugging Face model folder (default: the tiny demo model)")
    p.add_argument("--layers", metavar="all|LIST", help="'all' or indices like 0,4,-1 (default: all)")
    p.add_argument("--pooling", metavar="last|mean", help="pool the last token or the mean (default: last)")
    p.add_argument("--dtype", metavar="float32|float16|bfloat16", help="engine and stored dtype (default: float32)")
    p.add_argument("--text-column", metavar="COL", help="column holding the text (default: text)")
    p.add_argument(
        "--remove-period", action=argparse.BooleanOptionalAction, default=None,
        help="also strip trailing periods when normalising (part of the extraction key)",
    )
    p.add_argument("--batch-size", metavar="N", help="prompts per extraction batch (default: 1024)")
    p.add_argument("--parity-sample", metavar="N", help="prompts checked against Hugging Face (default: 8; 0 = off)")
    p.add_argument("--max-num-batched-tokens", metavar="N", help="engine tokens per step (default: engine's)")
    p.add_argument("--max-model-len", metavar="N", help="longest prompt in tokens (default: model's)")
    p.add_argument("--gpu-memory-utilization", metavar="F", help="engine memory share (default: runner picks)")
    p.add_argument("--tensor-parallel-size", metavar="N", help="GPUs per engine (default: 1)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="disable graph capture in the engine")
    p.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                   help="allow model folders that ship their own code")
    p.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=None,
                   help="cut prompts longer than the model's context instead of rejecting them")
    p.add_argument("--lock-timeout", metavar="SECONDS",
                   help="wait this long for another run holding the store (default: 0, fail at once)")
    p.add_argument("--env-file", metavar="PATH", default=".env", help="dotenv file to read (default: .env)")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")


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
    run.add_argument(
        "--input", nargs="+", action="extend", metavar="PATH",
        help="CSV/TSV/Parquet/JSONL files or globs (repeatable)",
    )
    run.add_argument("--store", metavar="DIR", help="store folder (default: ./layertap-store)")
    _engine_options(run)
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser(
        "demo", help="build the tiny model, embed the shipped sample and show how to read it", epilog=epilog
    )
    demo.add_argument(
        "--store", metavar="DIR", default=DEMO_STORE,
        help=f"store folder (default: {DEMO_STORE}; LAYERTAP_STORE is not used, so the demo never mixes into it)",
    )
    _engine_options(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


_SETTING_ARGS = (
    "input", "text_column", "model", "layers", "pooling", "dtype", "store", "remove_period", "batch_size",
    "parity_sample", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization",
    "tensor_parallel_size", "enforce_eager", "trust_remote_code", "truncate", "lock_timeout",
)


def settings_from_args(args: argparse.Namespace, **forced: Any):
    """CLI values on top of env and .env; an option not given on the command line is left to them."""
    from layertap.settings import load_settings

    given = {name: getattr(args, name, None) for name in _SETTING_ARGS}
    given.update(forced)
    env_file = args.env_file if args.env_file and Path(args.env_file).is_file() else None
    if args.env_file and args.env_file != ".env" and env_file is None:
        raise FileNotFoundError(f"env file {args.env_file} does not exist")
    return load_settings(env_file=env_file, **given)


def preflight(settings) -> None:
    """Cheap checks before Prefect starts, so common mistakes fail fast with one clear line."""
    from layertap.errors import InputError

    if not settings.input:
        raise InputError("input: no input files given (--input or LAYERTAP_INPUT)")
    for pattern in settings.input:
        path = os.path.expanduser(pattern)
        if not os.path.exists(path) and not glob.glob(path, recursive=True):
            raise InputError(f"input: no file matches {pattern}")
    if settings.model:
        from layertap.layers import resolve_layers
        from layertap.model_fingerprint import read_model_info

        if not Path(settings.model).expanduser().is_dir():
            raise InputError(f"model: {settings.model} is not a folder")
        info = read_model_info(Path(settings.model).expanduser())
        resolve_layers(settings.layer_spec(), info.num_layers)
    from layertap.preflight import check_run

    check_run(settings)


def run_flow(settings) -> dict:
    """Run the embed flow in this process with fully resolved settings."""
    from flows.embed import embed_flow

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


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    preflight(settings)
    summary = run_flow(settings)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_summary(summary, "layertap run")
    return EXIT_QUARANTINED if summary.get("quarantined") else EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    settings = settings_from_args(args, input=[str(SAMPLE_DATA)], text_column="text")
    preflight(settings)
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
