"""Hugging Face reference engine: `output_hidden_states=True`, one prompt at a time.

It is the yardstick the vLLM runner is checked against (the parity sample), so it is deliberately the
plainest possible code: no padding, no batching tricks, the model's own forward.
"""

from __future__ import annotations

import gc

import numpy as np

from layertap.errors import EngineError
from layertap.model_fingerprint import parameter_count, read_model_info
from layertap.runner.base import POOLINGS, Extraction

# GPU memory the reference needs beyond its weights: one short prompt's activations, the allocator's slack.
REFERENCE_SLACK_BYTES = 2 * 2**30
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class HfRunner:
    """Pools hidden states with transformers on CPU (or `device`), for parity checks and as a fallback."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        info = read_model_info(model)
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        # Straight onto the device, never whole in host memory on the way.
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code,
            device_map=None if device == "cpu" else device,
        ).eval()

    def extract(self, texts: list[str], layers: list[int], pooling: str) -> Extraction:
        import torch

        if pooling not in POOLINGS:
            raise EngineError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
        out = {layer: np.empty((len(texts), self.hidden_size), np.float32) for layer in layers}
        tokens = 0
        with torch.inference_mode():
            for row, text in enumerate(texts):
                enc = self.tokenizer(text, return_tensors="pt").to(self.device)
                tokens += enc["input_ids"].shape[1]
                hidden = self.model(**enc, output_hidden_states=True).hidden_states
                for layer in layers:
                    states = hidden[layer][0].float()
                    pooled = states[-1] if pooling == "last" else states.mean(0)
                    out[layer][row] = pooled.cpu().numpy()
        return Extraction(out, list(range(len(texts))), num_tokens=tokens)

    def close(self) -> None:
        """Free the model's memory now, on the device too: the engine beside it keeps running."""
        self.model = None
        gc.collect()
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()


def reference_bytes(model: str, dtype: str) -> int | None:
    """Device memory the reference needs in `dtype`: its weights plus slack; None when the folder's weights
    cannot be counted from their headers."""
    count = parameter_count(model)
    return None if count is None else count * _ITEMSIZE[dtype] + REFERENCE_SLACK_BYTES


def reference_placement(model: str, engine_dtype: str) -> tuple[str, str]:
    """(device, dtype) of the parity reference: on the GPU in the engine's dtype when it fits in the memory
    free there (the engine's default share leaves that room: `vllm_runner.default_gpu_memory_share`), so a
    7B model's reference never needs 28 GB of host memory; otherwise on the CPU in float32."""
    import torch

    if torch.cuda.is_available():
        needed = reference_bytes(model, engine_dtype)
        if needed is not None and needed <= torch.cuda.mem_get_info()[0]:
            return "cuda", engine_dtype
    return "cpu", "float32"


def hf_reference(
    model: str, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool = False,
    engine_dtype: str = "float32",
) -> dict[int, np.ndarray]:
    """`texts` pooled by transformers, placed by `reference_placement`: the parity sample's reference. The
    model is loaded for this call only, and its memory freed after."""
    device, dtype = reference_placement(model, engine_dtype)
    reference = HfRunner(model, dtype, device, trust_remote_code=trust_remote_code)
    try:
        return reference.extract(texts, layers, pooling).vectors
    finally:
        reference.close()
