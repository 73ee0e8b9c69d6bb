"""Hugging Face reference engine: `output_hidden_states=True`, one prompt at a time.

It is the yardstick the vLLM runner is checked against (the parity sample), so it is deliberately the
plainest possible code: no padding, no batching tricks, the model's own forward.
"""

from __future__ import annotations

import numpy as np

from layertap.errors import EngineError
from layertap.model_fingerprint import read_model_info
from layertap.runner.base import POOLINGS, Extraction


class HfRunner:
    """Pools hidden states with transformers on CPU (or `device`), for parity checks and as a fallback."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        info = read_model_info(model)
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        ).to(device).eval()

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
        self.model = None


def hf_reference(
    model: str, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool = False
) -> dict[int, np.ndarray]:
    """`texts` pooled by transformers in float32 on the CPU: the parity sample's reference. The model is
    loaded for this call only."""
    reference = HfRunner(model, "float32", trust_remote_code=trust_remote_code)
    try:
        return reference.extract(texts, layers, pooling).vectors
    finally:
        reference.close()
