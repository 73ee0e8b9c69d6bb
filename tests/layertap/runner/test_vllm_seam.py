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


def test_vllm_looking_up_the_worker_extension_hooks_model_loading_whatever_was_imported_first(fresh_python):
    """A process started by spawning imports its parent's main module first, which may import this module
    before vLLM (a warm engine's does): vLLM's own lookup of the extension must still hook model loading,
    or the engine's model is never tapped."""
    check = (
        "import sys\n"
        "import layertap.runner.vllm_seam as seam\n"
        "assert 'vllm' not in sys.modules\n"
        "from vllm.utils.import_utils import resolve_obj_by_qualname\n"
        "from vllm.model_executor.model_loader.base_loader import BaseModelLoader\n"
        "assert not getattr(BaseModelLoader.load_model, '_layertap', False)\n"
        "extension = resolve_obj_by_qualname(seam.EXTENSION)\n"
        "assert hasattr(extension, 'layertap_install')\n"
        "assert BaseModelLoader.load_model._layertap\n"
    )
    fresh_python(check)
