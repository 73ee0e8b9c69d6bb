"""The run options: one validated object built from CLI args, LAYERTAP_* env vars, a `.env` file and defaults.

Precedence is CLI > environment > `.env` > default. CLI values are passed as init kwargs, which
pydantic-settings ranks above every other source. Validation problems are reported as one line naming the
setting, so a typo in an env var is as easy to spot as a typo on the command line.

This model is the one list of run options: the command line's flags, the `embed` flow's parameters,
prefect.yaml's parameters, the options a dataset fixes and the engine options are all read off it
(tests/test_options_drift.py fails when one of them lists another set).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

ENV_PREFIX = "LAYERTAP_"
DEPLOYMENT_LOCK_WAIT_S = 6 * 3600.0

_LAYERS_RE = re.compile(r"^-?\d+(,-?\d+)*$")


def option(help: str, metavar: str | None = None, default: Any = None, *, extraction: bool = False,
           engine: bool = False, **checks: Any) -> Any:
    """A run option: its default and checks, plus what the command line shows (help, metavar) and where else
    it goes (`extraction`: fixed by a dataset, part of its vectors' key; `engine`: fixes an engine instance),
    so every list of options is read off this model instead of written again."""
    if "default_factory" not in checks:
        checks["default"] = default
    return Field(description=help, json_schema_extra={"metavar": metavar, "extraction": extraction, "engine": engine},
                 **checks)



class Settings(BaseSettings):
    """Everything one `embed` run needs; engine options left at None let the runner choose."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
        frozen=True,
    )

    # Inputs. NoDecode keeps pydantic-settings from demanding JSON for the list in env vars.
    input: Annotated[list[str], NoDecode] = option(
        "CSV/TSV/Parquet/JSONL files or globs (repeatable)", "PATH", default_factory=list)
    text_column: str = option("column holding the text (default: text)", "COL", "text")

    # Extraction key: a dataset fixes these when it is first added.
    model: str | None = option("Hugging Face model folder (default: the tiny demo model)", "DIR", extraction=True)
    layers: str = option("'all' or indices like 0,4,-1 (default: all)", "all|LIST", "all", extraction=True)
    pooling: Literal["last", "mean"] = option(
        "pool the last token or the mean (default: last)", "last|mean", "last", extraction=True)
    dtype: Literal["float32", "float16", "bfloat16"] = option(
        "engine dtype (default: float32)", "float32|float16|bfloat16", "float32", extraction=True)
    # How vectors are stored: float32 holds every float32, float16 and bfloat16 value exactly; float16 takes
    # half the bytes and holds a bfloat16 value exactly when it lies inside float16's range (a batch with one
    # outside fails its checks). None: float16 for a float16 engine, float32 otherwise.
    store_dtype: Literal["float32", "float16"] | None = option(
        "stored dtype: float16 halves the bytes (default: float32; float16 for a float16 engine)",
        "float32|float16", extraction=True)
    remove_period: bool = option(
        "also strip trailing periods when normalising (part of the extraction key)", default=False, extraction=True)

    # Where results live.
    store: str = option("store folder (default: ./layertap-store)", "DIR", "./layertap-store")

    # Work sizing and checks.
    batch_size: int = option("prompts per extraction batch (default: 1024)", "N", 1024, ge=1)
    # Batches extracted at once: the engine computes some while the others are written and published; each
    # holds a host buffer. Four keep a 7B model's engine busy on short prompts, where writing is heaviest.
    batches_in_flight: int = option(
        "batches extracted at once, so writing overlaps the engine (default: 4)", "N", 4, ge=1)
    # Largest Parquet file a batch is written as (MB of vectors before compression): a bigger batch is split
    # by rows into files encoded in parallel, one per core at most, so writing keeps up with a GPU.
    part_file_mb: float = option(
        "largest Parquet file a batch is written as, in MB of vectors; a bigger batch is split into files "
        "written in parallel (default: 128)", "MB", 128, gt=0)
    parity_sample: int = option("prompts checked against Hugging Face (default: 8; 0 = off)", "N", 8, ge=0)
    # Prompts longer than the model's context are rejected unless the user asks to cut them to fit.
    truncate: bool = option(
        "cut prompts longer than the model's context instead of rejecting them", default=False)
    # Seconds a run waits for another run holding the store's lock; 0 fails at once, naming the holder. None:
    # 0 on the command line; DEPLOYMENT_LOCK_WAIT_S for deployment runs, which wait their turn on a shared store.
    lock_timeout: float | None = option(
        "wait this long for another run holding the store (default: 0, fail at once)", "SECONDS", ge=0)

    # Engine options, passed through to the runner (`engine_options`).
    max_num_batched_tokens: int | None = option(
        "engine tokens per step (default: engine's)", "N", ge=1, engine=True)
    max_model_len: int | None = option("longest prompt in tokens (default: model's)", "N", ge=1, engine=True)
    gpu_memory_utilization: float | None = option(
        "engine memory share (default: runner picks)", "F", gt=0, le=1, engine=True)
    tensor_parallel_size: int = option("GPUs per engine (default: 1)", "N", 1, ge=1, engine=True)
    enforce_eager: bool | None = option("disable graph capture in the engine", engine=True)
    # vLLM's engine core in a process of its own instead of the caller's; None: on a GPU, not on a CPU.
    engine_process: bool | None = option(
        "run vLLM's engine core in a process of its own (default: yes on a GPU, no on a CPU)", engine=True)
    # The runner (vLLM's frontend) in a process of its own, apart from the flow's Prefect and writers; None:
    # on a GPU, not on a CPU.
    runner_process: bool | None = option(
        "run the runner (vLLM's frontend) in a process of its own, apart from the flow's (default: yes on a GPU, "
        "no on a CPU)", engine=True)
    trust_remote_code: bool = option("allow model folders that ship their own code", default=False, engine=True)
    # "dummy" starts the engine with random weights of the model's shape: for speed runs only.
    load_format: Literal["auto", "dummy"] | None = option(
        "'dummy' starts the engine with random weights of the model's shape, for speed runs only "
        "(default: auto, the model's weights)", "auto|dummy", engine=True)
    # Keep the engine up between runs, in a process of its own that runs attach to (`warm_engine`), so a
    # small incremental run skips vLLM's start. None: when a Prefect deployment runs the flow.
    warm_engine: bool | None = option(
        "use (or start) a warm engine that stays up between runs (default: yes when a Prefect deployment runs "
        "the flow, no here)")
    # Seconds a warm engine stays up with no run attached before it exits and frees the device.
    engine_idle_timeout: float = option(
        "seconds a warm engine stays up with no run attached (default: 600)", "SECONDS", 600.0, ge=0)
    # Where warm engines keep their sockets and status files (default: ~/.cache/layertap/engines/<host>).
    engine_dir: str | None = option(
        "where warm engines keep their sockets and status (default: ~/.cache/layertap/engines/<host>)", "DIR")

    # Where batches are extracted: "local", engines of this process (or warm ones on this machine); "ray",
    # engines that are actors of a Ray cluster (`layertap.runner.ray_engines`, the `ray` extra).
    executor: Literal["local", "ray"] = option(
        "extract on this machine's engine, or on engines that are actors of a Ray cluster (default: local)",
        "local|ray", "local")
    # The Ray cluster's address (head:6379, ray://head:10001, auto); None: RAY_ADDRESS, and without it a local
    # cluster started for the run.
    ray_address: str | None = option(
        "the Ray cluster for --executor ray, e.g. head:6379 (default: RAY_ADDRESS, else a local cluster started "
        "for the run)", "ADDRESS")
    # Engines (actors) on the cluster: "auto" is its GPUs / tensor_parallel_size, or on CPUs one per node.
    engines: str = option(
        "engines on the Ray cluster (default: auto, its GPUs / tensor-parallel size; on CPUs one per node)",
        "auto|N", "auto")
    # Seconds a batch may take on a Ray engine before the engine is taken as hung, killed and the batch retried.
    batch_timeout: float = option(
        "a batch running longer on a Ray engine counts as hung: the engine is restarted and the batch retried "
        "(default: 1800)", "SECONDS", 1800.0, gt=0)

    @field_validator("input", mode="before")
    @classmethod
    def _split_input(cls, value: Any) -> Any:
        """Accept a JSON list or a comma-separated string (env vars), or a list (CLI, code)."""
        if value is None:
            return []
        if isinstance(value, (str, Path)):
            text = str(value).strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not a JSON list of paths ({exc.msg})") from None
            return [part.strip() for part in text.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        return value

    @field_validator("text_column", "store")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value

    @field_validator(
        "model",
        "store_dtype",
        "lock_timeout",
        "engine_dir",
        "warm_engine",
        "max_num_batched_tokens",
        "max_model_len",
        "gpu_memory_utilization",
        "enforce_eager",
        "ray_address",
        mode="before",
    )
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        """An empty env var (LAYERTAP_MODEL=) means "not set", not an empty path or a parse error."""
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        return value

    @field_validator("layers", mode="before")
    @classmethod
    def _check_layers(cls, value: Any) -> Any:
        """Keep the spec as a canonical string ("all" or "0,4,-1"); resolving needs the model's depth."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, str):
            return value
        spec = re.sub(r"\s+", "", value).lower()
        if spec == "all":
            return spec
        if not _LAYERS_RE.match(spec):
            raise ValueError(f"expected 'all' or a comma list of layer indices like '0,4,-1', got {value!r}")
        seen: list[str] = []
        for part in spec.split(","):
            canon = str(int(part))
            if canon not in seen:
                seen.append(canon)
        return ",".join(seen)

    @field_validator("engines", mode="before")
    @classmethod
    def _check_engines(cls, value: Any) -> Any:
        """"auto" or a positive whole number, kept as a string."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            return value
        spec = value.strip().lower()
        if spec == "auto" or (spec.isdigit() and int(spec) >= 1):
            return "auto" if spec == "auto" else str(int(spec))
        raise ValueError(f"expected 'auto' or a number of engines of at least 1, got {value!r}")

    def engine_count(self) -> int | None:
        """The number of engines asked for; None for "auto" (the cluster decides)."""
        return None if self.engines == "auto" else int(self.engines)

    def layer_spec(self) -> str | list[int]:
        """The layer request in the form `layertap.model.layers.resolve_layers` takes."""
        if self.layers == "all":
            return "all"
        return [int(p) for p in self.layers.split(",")]

    def engine_options(self) -> dict[str, Any]:
        """Options for the runner constructor; None values are left out so the runner's defaults apply."""
        values = {name: getattr(self, name) for name in ENGINE_OPTIONS}
        return {k: v for k, v in values.items() if v is not None}

    def stored_dtype(self) -> str:
        """The dtype vectors are stored in (`store_dtype`, or the engine dtype's default)."""
        return stored_dtype_for(self.dtype, self.store_dtype)

    def store_path(self) -> Path:
        return Path(self.store).expanduser().resolve()

    def demo_model_dir(self) -> Path:
        """Where the embedded tiny model is built when no model is given: next to the store, not inside it."""
        return self.store_path().parent / ".layertap" / "tiny-model"


def options_marked(mark: str) -> tuple[str, ...]:
    """The options `option()` marked with `mark` ("extraction" or "engine"), in the model's order."""
    return tuple(name for name, field in Settings.model_fields.items()
                 if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get(mark))


# The options that decide a dataset's vectors (fixed when the dataset is first added), and those that fix an
# engine instance (`EngineOptions` has a field of the same name for each).
EXTRACTION_OPTIONS = options_marked("extraction")
ENGINE_OPTIONS = options_marked("engine")


# Bytes of one value of each engine dtype.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def stored_dtype_for(dtype: str, store_dtype: str | None = None) -> str:
    """The stored dtype of an engine of `dtype`: as asked, else float16 for float16 values, float32 otherwise."""
    return store_dtype or ("float16" if dtype == "float16" else "float32")


def settings_error_line(exc: ValidationError) -> str:
    """One line naming each bad setting, the env var that sets it, and why it is bad."""
    problems = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        name = str(loc[0]) if loc else "settings"
        msg = err.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        given = err.get("input")
        where = f"{name} ({ENV_PREFIX}{name.upper()})" if name in Settings.model_fields else name
        detail = f"invalid setting {where}: {msg}"
        if isinstance(given, (str, int, float, bool)) and repr(given) not in msg and str(given) not in msg:
            detail += f" (got {given!r})"
        problems.append(detail)
    return "; ".join(problems)


def load_settings(env_file: str | Path | None = ".env", **overrides: Any) -> Settings:
    """Build settings with `overrides` (e.g. CLI values) on top; None overrides are ignored, not forced."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return Settings(_env_file=env_file, **given)  # type: ignore[call-arg]
