"""The parity sample's transformers reference: loaded tensor by tensor, the same model as `from_pretrained`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def test_the_reference_is_built_from_the_folder_s_own_weights_one_tensor_at_a_time(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from layertap.runner.hf_runner import _load_model

    ours = _load_model(tiny_model, torch.bfloat16, "cpu", False).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_weights_under_names_the_model_lacks_load_through_transformers(tiny_model, tmp_path):
    """A folder whose tensor names are not the model's own (an older naming, say) is left to
    `from_pretrained`, which knows how to map them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from layertap.runner.hf_runner import _read_weights_into

    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_model, renamed)
    for path in renamed.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({f"extra.{name}" if i == 0 else name: t for i, (name, t) in enumerate(tensors.items())}, path,
                  metadata={"format": "pt"})
    built = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not _read_weights_into(built, sorted(renamed.glob("*.safetensors")))
    assert _read_weights_into(built, sorted(Path(tiny_model).glob("*.safetensors")))
