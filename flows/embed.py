"""The `embed` flow: input rows in, validated per-layer embeddings in the store out (see
`flows.pipeline`). Its parameters are the options model's fields (`layertap.settings.Settings`), so a
deployment runs exactly what `layertap run` does.

The parameters are spelled out, not generated, because Prefect reads a flow's parameters from its source;
tests/test_options_drift.py fails when they and the model disagree."""

from __future__ import annotations

from prefect import flow
from pydantic import ValidationError

from flows.pipeline import resolve_model, run_pipeline
from layertap.errors import InputError
from layertap.settings import load_settings, settings_error_line

__all__ = ["embed_flow", "resolve_model"]


@flow(name="embed", log_prints=False, result_serializer="json")
def embed_flow(
    input: list[str] | str | None = None,
    text_column: str | None = None,
    model: str | None = None,
    layers: str | list[int] | None = None,
    pooling: str | None = None,
    dtype: str | None = None,
    store_dtype: str | None = None,
    remove_period: bool | None = None,
    store: str | None = None,
    batch_size: int | None = None,
    batches_in_flight: int | None = None,
    part_file_mb: float | None = None,
    parity_sample: int | None = None,
    truncate: bool | None = None,
    lock_timeout: float | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    tensor_parallel_size: int | None = None,
    enforce_eager: bool | None = None,
    engine_process: bool | None = None,
    runner_process: bool | None = None,
    trust_remote_code: bool | None = None,
    load_format: str | None = None,
    warm_engine: bool | None = None,
    engine_idle_timeout: float | None = None,
    engine_dir: str | None = None,
    executor: str | None = None,
    ray_address: str | None = None,
    engines: str | int | None = None,
    batch_timeout: float | None = None,
    env_file: str | None = ".env",
) -> dict:
    """Embed every input row's prompt at the requested layers; parameters left at None come from
    LAYERTAP_* environment variables, then `env_file`, then the defaults."""
    given = {name: value for name, value in locals().items() if name != "env_file"}
    try:
        settings = load_settings(env_file=env_file, **given)
    except ValidationError as exc:
        raise InputError(settings_error_line(exc)) from None
    return run_pipeline(settings)
