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


def test_a_reference_beside_an_engine_is_loaded_once_and_freed_when_it_closes(tiny_model):
    """A small model's reference is kept between calls (a kept engine's later runs read no weights); asking
    with another trust_remote_code loads it anew; closing frees it. Its vectors are transformers' own."""
    from layertap.runner.hf_runner import HfRunner, ParityReference

    expected = HfRunner(tiny_model, "float32")
    reference = ParityReference(tiny_model, "float32")
    for texts in (["a first prompt", "and a second"], ["another run's sample"]):
        got = reference.vectors(texts, [0, 2], "last")
        want = expected.extract(texts, [0, 2], "last").vectors
        assert all(torch.equal(torch.from_numpy(got[k]), torch.from_numpy(want[k])) for k in (0, 2))
    assert reference.loads == 1 and reference.loaded
    reference.vectors(["x"], [1], "mean", trust_remote_code=True)
    assert reference.loads == 2
    reference.close()
    assert not reference.loaded


def test_a_reference_that_would_hold_much_host_memory_is_freed_after_each_call(tiny_model, monkeypatch):
    """On the CPU a large model's reference (28 GB in float32 for a 7B model) is not kept; nor is a one-off's."""
    from layertap.runner import hf_runner

    monkeypatch.setattr(hf_runner, "KEEP_ON_HOST_BYTES", 0)  # the tiny model counts as large
    reference = hf_runner.ParityReference(tiny_model, "float32")
    reference.vectors(["a prompt"], [1], "last")
    reference.vectors(["a prompt"], [1], "last")
    assert reference.loads == 2 and not reference.loaded
    monkeypatch.undo()
    one_off = hf_runner.ParityReference(tiny_model, "float32", keep=False)
    one_off.vectors(["a prompt"], [1], "last")
    assert not one_off.loaded
