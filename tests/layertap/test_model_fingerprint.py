"""A model folder's fingerprint follows its content, and stays cheap on large weight files."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from layertap.errors import InputError
from layertap.model_fingerprint import WHOLE_FILE_LIMIT, fingerprint_model, read_model_info
from layertap.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fp") / "llama")


def copy_of(tiny, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny, target)
    return target


def test_same_content_same_fingerprint_anywhere(tiny, tmp_path):
    assert fingerprint_model(tiny) == fingerprint_model(copy_of(tiny, tmp_path))


def test_config_change_invalidates(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (model / "config.json").write_text(json.dumps(config))
    assert fingerprint_model(model) != fingerprint_model(tiny)


def test_weight_change_invalidates(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert fingerprint_model(model) != fingerprint_model(tiny)


def test_large_weights_fingerprint_in_well_under_a_second(tiny, tmp_path):
    model = copy_of(tiny, tmp_path)
    big = model / "model-00002-of-00002.safetensors"
    with big.open("wb") as handle:  # sparse: 4 GiB on paper, nothing on disk
        handle.truncate(4 * 2**30)
    assert big.stat().st_size > WHOLE_FILE_LIMIT
    started = time.perf_counter()
    before = fingerprint_model(model)
    assert time.perf_counter() - started < 1.0
    with big.open("r+b") as handle:  # rewriting a large file changes its mtime and sampled bytes
        handle.seek(2 * 2**30)
        handle.write(b"changed")
    os.utime(big, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert fingerprint_model(model) != before


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(InputError, match="has no config.json"):
        fingerprint_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match="num_hidden_layers"):
        read_model_info(tmp_path)
