"""Run settings: one validated object built from CLI args, LAYERTAP_* env vars, a `.env` file and defaults.

Precedence is CLI > environment > `.env` > default. CLI values are passed as init kwargs, which
pydantic-settings ranks above every other source. Validation problems are reported as one line naming the
setting, so a typo in an env var is as easy to spot as a typo on the command line.
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
    input: Annotated[list[str], NoDecode] = Field(default_factory=list)
    text_column: str = "text"

    # Extraction key.
    model: str | None = None
    layers: str = "all"
    pooling: Literal["last", "mean"] = "last"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # How vectors are stored: float32 holds every float32, float16 and bfloat16 value exactly; float16 takes
    # half the bytes and holds a bfloat16 value exactly when it lies inside float16's range (a batch with one
    # outside fails its checks). None: float16 for a float16 engine, float32 otherwise.
    store_dtype: Literal["float32", "float16"] | None = None
    remove_period: bool = False

    # Where results live.
    store: str = "./layertap-store"

    # Work sizing and checks.
    batch_size: int = Field(1024, ge=1)
    # Batches extracted at once: the engine computes some while the others are written and published. With
    # three, a 7B model's 100,000 short prompts left an H200 idle a fifth of the time; four cut that to an
    # eighth, for one more host buffer (bench/README.md).
    batches_in_flight: int = Field(4, ge=1)
    # Largest Parquet file a batch is written as (MB of vectors before compression): a bigger batch is split
    # by rows into files encoded in parallel, one per core at most, so writing keeps up with a GPU.
    part_file_mb: float = Field(128, gt=0)
    parity_sample: int = Field(8, ge=0)
    # Prompts longer than the model's context are rejected unless the user asks to cut them to fit.
    truncate: bool = False
    # Seconds a run waits for another run holding the store's lock; 0 fails at once, naming the holder. None:
    # 0 on the command line; DEPLOYMENT_LOCK_WAIT_S for deployment runs, which wait their turn on a shared store.
    lock_timeout: float | None = Field(None, ge=0)

    # Engine options, passed through to the runner.
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    enforce_eager: bool | None = None
    # vLLM's engine core in a process of its own instead of the caller's; None: on a GPU, not on a CPU.
    engine_process: bool | None = None
    # The runner (vLLM's frontend) in a process of its own, apart from the flow's Prefect and writers; None:
    # on a GPU, not on a CPU.
    runner_process: bool | None = None
    trust_remote_code: bool = False
    # Keep the engine up between runs, in a process of its own that runs attach to (`warm_engine`), so a
    # small incremental run skips vLLM's start. None: when a Prefect deployment runs the flow.
    warm_engine: bool | None = None
    # Seconds a warm engine stays up with no run attached before it exits and frees the device.
    engine_idle_timeout: float = Field(600.0, ge=0)
    # Where warm engines keep their sockets and status files (default: ~/.cache/layertap/engines/<host>).
    engine_dir: str | None = None
    # "dummy" starts the engine with random weights of the model's shape: for speed runs only.
    load_format: Literal["auto", "dummy"] | None = None

    # Where batches are extracted: "local", engines of this process (or warm ones on this machine); "ray",
    # engines that are actors of a Ray cluster (`layertap.ray_engines`, the `ray` extra).
    executor: Literal["local", "ray"] = "local"
    # The Ray cluster's address (head:6379, ray://head:10001, auto); None: RAY_ADDRESS, and without it a local
    # cluster started for the run.
    ray_address: str | None = None
    # Engines (actors) on the cluster: "auto" is its GPUs / tensor_parallel_size, or on CPUs one per node.
    engines: str = "auto"
    # Seconds a batch may take on a Ray engine before the engine is taken as hung, killed and the batch retried.
    batch_timeout: float = Field(1800.0, gt=0)

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
        """The layer request in the form `layertap.layers.resolve_layers` takes."""
        if self.layers == "all":
            return "all"
        return [int(p) for p in self.layers.split(",")]

    def engine_options(self) -> dict[str, Any]:
        """Options for the runner constructor; None values are left out so the runner's defaults apply."""
        opts = {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
            "engine_process": self.engine_process,
            "runner_process": self.runner_process,
            "trust_remote_code": self.trust_remote_code,
            "load_format": self.load_format,
        }
        return {k: v for k, v in opts.items() if v is not None}

    def stored_dtype(self) -> str:
        """The dtype vectors are stored in (`store_dtype`, or the engine dtype's default)."""
        return stored_dtype_for(self.dtype, self.store_dtype)

    def store_path(self) -> Path:
        return Path(self.store).expanduser().resolve()

    def demo_model_dir(self) -> Path:
        """Where the embedded tiny model is built when no model is given: next to the store, not inside it."""
        return self.store_path().parent / ".layertap" / "tiny-model"


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
