"""The vLLM seam refuses a vLLM outside the tested range with one line, before an engine starts."""

from __future__ import annotations

import pytest

from layertap.errors import EngineError
from layertap.runner import vllm_seam


@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cu128", "0.29.1", "0.32.0", "0.32.3.dev2+g1234"])
def test_versions_in_the_tested_range_are_accepted(version):
    assert vllm_seam.check_version(version) == version


@pytest.mark.parametrize("version", ["0.25.9", "0.33.0", "0.33.0rc1", "1.0.0", "unknown"])
def test_a_version_outside_the_tested_range_is_one_clear_line(version):
    with pytest.raises(EngineError) as refused:
        vllm_seam.check_version(version)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"vLLM {version} is outside the range layertap is tested with (>=0.26.0,<0.33")


def test_the_installed_vllm_is_in_the_tested_range():
    import vllm

    assert vllm_seam.check_vllm() == vllm.__version__


def test_an_engine_refuses_to_start_on_a_vllm_outside_the_range(monkeypatch, tmp_path):
    """The check runs at engine start, before the model folder is read or vLLM is started."""
    import vllm

    from layertap.runner.engine_options import EngineOptions
    from layertap.runner.vllm_runner import VllmRunner

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(EngineError, match=r"^vLLM 0\.33\.0 is outside the range layertap is tested with"):
        VllmRunner(EngineOptions(model=str(tmp_path / "no-model")))
