"""A model folder's fingerprint follows its content, and stays cheap on large weight files."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from layertap.errors import InputError
from layertap.model.fingerprint import WHOLE_FILE_LIMIT, fingerprint_model, read_model_info
from layertap.model.tiny_model import build_tiny_model


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


def test_parameter_count_reads_the_safetensors_headers_only(tiny, tmp_path):
    """What the parity reference's device memory is sized from: every weight stored, without loading any."""
    from safetensors.torch import load_file

    from layertap.model.fingerprint import parameter_count

    stored = sum(t.numel() for f in sorted(os.listdir(tiny)) if f.endswith(".safetensors")
                 for t in load_file(os.path.join(tiny, f)).values())
    assert parameter_count(tiny) == stored > 0
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(os.path.join(tiny, "config.json"), config_only)
    assert parameter_count(config_only) is None


def test_the_parity_reference_runs_in_float32_on_a_machine_without_a_gpu(tiny):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from layertap.runner.hf_runner import REFERENCE_SLACK_BYTES, reference_bytes, reference_placement
    from layertap.model.fingerprint import parameter_count

    assert reference_placement(str(tiny), "bfloat16") == ("cpu", "float32")
    assert reference_bytes(str(tiny), "bfloat16") == 2 * parameter_count(tiny) + REFERENCE_SLACK_BYTES
