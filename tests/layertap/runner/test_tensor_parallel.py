"""Tensor parallelism: two ranks, each in its own process, still give full hidden vectors.

vLLM's CPU workers bind their threads to cores, so each rank gets one core of its own; the engine runs
in a child process to keep that binding and the worker processes out of the test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from layertap.runner.hf_runner import HfRunner
    from layertap.runner.vllm_runner import EngineOptions, VllmRunner

    def main():
        model = sys.argv[1]
        texts = ["hello world", "tensor parallel ranks " * 12, "x", "another prompt."]
        layers = [0, 1, 2, 4]
        runner = VllmRunner(EngineOptions(model=model, tensor_parallel_size=2, max_num_batched_tokens=64,
                                          kv_cache_memory_bytes=128 * 2**20))
        try:
            ours = runner.extract(texts, layers, "last")
        finally:
            runner.close()
        ref = HfRunner(model).extract(texts, layers, "last")
        errors = {L: float(np.abs(ours.vectors[L] - ref.vectors[L][ours.kept]).max()) for L in layers}
        print("RESULT " + json.dumps({"kept": ours.kept, "errors": errors, "hidden": ours.vectors[0].shape[1]}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.skipif(torch.cuda.is_available() or (os.cpu_count() or 1) < 2, reason="CPU test with two cores")
def test_two_ranks_gather_full_vectors(tmp_path, model_dirs):
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    proc = subprocess.run([sys.executable, str(script), model_dirs["llama"]], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    assert result["kept"] == [0, 1, 2, 3] and result["hidden"] == 128
    assert max(result["errors"].values()) <= 1e-4, result["errors"]
