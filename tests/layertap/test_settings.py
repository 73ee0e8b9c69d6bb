"""Settings come from CLI values, LAYERTAP_* env vars, a .env file and defaults, in that order."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from layertap.settings import Settings, load_settings, settings_error_line


def error_line(**values) -> str:
    with pytest.raises(ValidationError) as info:
        load_settings(env_file=None, **values)
    return settings_error_line(info.value)


def test_defaults():
    s = load_settings(env_file=None)
    assert s.input == [] and s.text_column == "text" and s.model is None
    assert (s.layers, s.pooling, s.dtype, s.remove_period) == ("all", "last", "float32", False)
    assert s.store == "./layertap-store"
    assert (s.batch_size, s.parity_sample) == (1024, 8)
    assert s.max_num_batched_tokens is None and s.max_model_len is None
    assert s.gpu_memory_utilization is None and s.enforce_eager is None and s.engine_process is None
    assert (s.tensor_parallel_size, s.trust_remote_code) == (1, False)
    assert (s.executor, s.ray_address, s.engines, s.batch_timeout) == ("local", None, "auto", 1800.0)


def test_ray_options_from_env(monkeypatch):
    monkeypatch.setenv("LAYERTAP_EXECUTOR", "ray")
    monkeypatch.setenv("LAYERTAP_RAY_ADDRESS", "head:6379")
    monkeypatch.setenv("LAYERTAP_ENGINES", " 4 ")
    s = load_settings(env_file=None)
    assert (s.executor, s.ray_address, s.engines, s.engine_count()) == ("ray", "head:6379", "4", 4)
    assert load_settings(env_file=None, engines="AUTO").engine_count() is None
    monkeypatch.setenv("LAYERTAP_RAY_ADDRESS", "")
    assert load_settings(env_file=None).ray_address is None


def test_env_vars_fill_every_kind_of_field(monkeypatch):
    monkeypatch.setenv("LAYERTAP_INPUT", "a.csv, data/*.parquet")
    monkeypatch.setenv("LAYERTAP_POOLING", "mean")
    monkeypatch.setenv("LAYERTAP_REMOVE_PERIOD", "true")
    monkeypatch.setenv("LAYERTAP_BATCH_SIZE", "64")
    monkeypatch.setenv("LAYERTAP_GPU_MEMORY_UTILIZATION", "0.3")
    monkeypatch.setenv("LAYERTAP_ENFORCE_EAGER", "false")
    monkeypatch.setenv("LAYERTAP_ENGINE_PROCESS", "true")
    s = load_settings(env_file=None)
    assert s.input == ["a.csv", "data/*.parquet"]
    assert s.pooling == "mean" and s.remove_period is True and s.batch_size == 64
    assert s.engine_options() == {
        "gpu_memory_utilization": 0.3,
        "enforce_eager": False,
        "engine_process": True,
        "tensor_parallel_size": 1,
        "trust_remote_code": False,
    }


def test_input_env_accepts_a_json_list(monkeypatch):
    monkeypatch.setenv("LAYERTAP_INPUT", '["x, with comma.csv", "y.jsonl"]')
    assert load_settings(env_file=None).input == ["x, with comma.csv", "y.jsonl"]


def test_blank_env_var_means_unset(monkeypatch):
    monkeypatch.setenv("LAYERTAP_MODEL", "")
    monkeypatch.setenv("LAYERTAP_MAX_MODEL_LEN", "")
    s = load_settings(env_file=None)
    assert s.model is None and s.max_model_len is None


def test_precedence_cli_over_env_over_dotenv_over_default(monkeypatch, tmp_path):
    (tmp_path / ".env").write_text("LAYERTAP_DTYPE=float16\nLAYERTAP_LAYERS=0,1\nLAYERTAP_BATCH_SIZE=7\nOTHER=1\n")
    monkeypatch.setenv("LAYERTAP_LAYERS", "2")
    monkeypatch.setenv("LAYERTAP_BATCH_SIZE", "9")
    s = load_settings(batch_size=11)  # reads ./.env
    assert s.dtype == "float16"  # .env over default
    assert s.layers == "2"  # env over .env
    assert s.batch_size == 11  # CLI over env
    assert s.pooling == "last"  # default


def test_settings_class_reads_dotenv_by_default(tmp_path):
    (tmp_path / ".env").write_text("LAYERTAP_TEXT_COLUMN=body\n")
    assert Settings().text_column == "body"


def test_none_overrides_do_not_mask_env(monkeypatch):
    monkeypatch.setenv("LAYERTAP_POOLING", "mean")
    assert load_settings(env_file=None, pooling=None).pooling == "mean"


@pytest.mark.parametrize(
    ("given", "canonical", "spec"),
    [
        ("all", "all", "all"),
        (" ALL ", "all", "all"),
        ("0, 4,-1", "0,4,-1", [0, 4, -1]),
        ("3,3,01", "3,1", [3, 1]),
        ([0, -1], "0,-1", [0, -1]),
        (5, "5", [5]),
    ],
)
def test_layers_are_kept_as_a_canonical_spec(given, canonical, spec):
    s = load_settings(env_file=None, layers=given)
    assert s.layers == canonical
    assert s.layer_spec() == spec


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"pooling": "max"}, "invalid setting pooling (LAYERTAP_POOLING): Input should be 'last' or 'mean'"),
        ({"dtype": "int8"}, "invalid setting dtype (LAYERTAP_DTYPE)"),
        ({"layers": "1;2"}, "invalid setting layers (LAYERTAP_LAYERS): expected 'all' or a comma list"),
        ({"batch_size": "abc"}, "invalid setting batch_size (LAYERTAP_BATCH_SIZE)"),
        ({"batch_size": 0}, "invalid setting batch_size (LAYERTAP_BATCH_SIZE): Input should be greater than"),
        ({"gpu_memory_utilization": 1.5}, "invalid setting gpu_memory_utilization"),
        ({"text_column": "  "}, "invalid setting text_column (LAYERTAP_TEXT_COLUMN): must not be empty"),
        ({"input": '["unclosed"'}, "invalid setting input (LAYERTAP_INPUT): not a JSON list of paths"),
        ({"executor": "dask"}, "invalid setting executor (LAYERTAP_EXECUTOR): Input should be 'local' or 'ray'"),
        ({"engines": "0"}, "invalid setting engines (LAYERTAP_ENGINES): expected 'auto' or a number of engines"),
        ({"engines": "many"}, "invalid setting engines (LAYERTAP_ENGINES): expected 'auto' or a number of engines"),
    ],
)
def test_errors_are_one_line_naming_the_setting(values, expected):
    line = error_line(**values)
    assert line.startswith(expected)
    assert "\n" not in line


def test_several_errors_share_one_line():
    line = error_line(pooling="max", dtype="int8")
    assert "\n" not in line
    assert "pooling" in line and "dtype" in line


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("LAYERTAP_TENSOR_PARALLEL_SIZE", "two")
    line = error_line()
    assert line.startswith("invalid setting tensor_parallel_size (LAYERTAP_TENSOR_PARALLEL_SIZE)")
    assert "'two'" in line


def test_demo_model_lives_next_to_the_store(tmp_path):
    s = load_settings(env_file=None, store=str(tmp_path / "stores" / "a"))
    assert s.store_path() == tmp_path / "stores" / "a"
    assert s.demo_model_dir() == tmp_path / "stores" / ".layertap" / "tiny-model"


def test_settings_are_immutable():
    s = load_settings(env_file=None)
    with pytest.raises(ValidationError):
        s.batch_size = 3
