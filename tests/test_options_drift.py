"""Every list of run options agrees with the one options model (`layertap.settings.Settings`): the command
line's flags, the `embed` flow's parameters, prefect.yaml's `embed` parameters, the options a dataset fixes
and the engine options. Adding an option to the model without the others (or the reverse) fails here."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import yaml

from flows.cli import build_parser, option_flag
from layertap.store import registry
from layertap.runner.engine_options import NOT_RUN_OPTIONS, EngineOptions
from layertap.settings import ENGINE_OPTIONS, EXTRACTION_OPTIONS, Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = list(Settings.model_fields)


def flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices[command]._actions for s in a.option_strings if s.startswith("--")}


def test_run_has_a_flag_for_every_option():
    assert {option_flag(name) for name in OPTIONS} <= flags("run")


def test_demo_has_a_flag_for_every_option_but_its_input():
    assert {option_flag(name) for name in OPTIONS if name != "input"} <= flags("demo")
    assert "--input" not in flags("demo")


def test_add_has_a_flag_for_every_option_a_dataset_fixes():
    wanted = {option_flag(name) for name in ("input", "store", "text_column", *EXTRACTION_OPTIONS)}
    assert wanted <= flags("add")
    assert not {option_flag(name) for name in OPTIONS} - wanted & flags("add")


def test_flags_parse_into_the_model():
    parsed = build_parser().parse_args(["run", "--input", "a.csv", "b.csv", "--input", "c.csv", "--part-file-mb", "64",
                                        "--load-format", "dummy", "--no-enforce-eager"])
    settings = load_settings(env_file=None, **{name: getattr(parsed, name) for name in OPTIONS})
    assert settings.input == ["a.csv", "b.csv", "c.csv"]
    assert (settings.part_file_mb, settings.load_format, settings.enforce_eager) == (64, "dummy", False)
    untouched = build_parser().parse_args(["run"])
    assert all(getattr(untouched, name) is None for name in OPTIONS)  # env vars and .env fill the rest


def test_embed_flow_parameters_are_the_options():
    from flows.embed import embed_flow

    params = inspect.signature(embed_flow.fn).parameters
    assert list(params) == [*OPTIONS, "env_file"]
    assert all(params[name].default is None for name in OPTIONS)


def test_prefect_yaml_lists_every_option_for_embed():
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    embed = next(d for d in deployments if d["name"] == "embed")
    assert list(embed["parameters"]) == OPTIONS
    assert all(value is None for value in embed["parameters"].values())


def test_dataset_fixed_options_come_from_the_model():
    assert registry.EXTRACTION_OPTIONS == EXTRACTION_OPTIONS
    assert EXTRACTION_OPTIONS == ("model", "layers", "pooling", "dtype", "store_dtype", "remove_period")
    assert set(registry.DATASET_FIXED) <= set(OPTIONS)


def test_engine_options_match_the_model():
    fields = {f.name: f for f in dataclasses.fields(EngineOptions)}
    assert set(fields) - set(NOT_RUN_OPTIONS) == set(ENGINE_OPTIONS)
    for name in ENGINE_OPTIONS:  # same defaults: an option left unset means the same engine either way
        assert fields[name].default == Settings.model_fields[name].default, name
    settings = load_settings(env_file=None, model="m", load_format="dummy", tensor_parallel_size=2)
    options = EngineOptions(model="m", dtype=settings.dtype, **settings.engine_options())
    assert (options.load_format, options.tensor_parallel_size) == ("dummy", 2)
