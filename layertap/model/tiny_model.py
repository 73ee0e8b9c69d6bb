"""Small random decoder models built locally, so demos and tests never download weights.

The tokenizer is byte-level (every UTF-8 byte is a token) with a BOS token, so any text tokenises
deterministically and long prompts are easy to make. Weights come from a fixed seed: the same call
always writes the same model, and its fingerprint stays stable between runs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Bumped whenever the recipe changes, so a cached build is rebuilt.
RECIPE_VERSION = 2

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma")


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )


def _config(arch: str, vocab_size: int, num_layers: int, hidden_size: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,  # head_dim 64: the CPU attention kernels need it
        num_key_value_heads=max(1, hidden_size // 128),
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.05,
        dtype="float32",
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(rms_norm_eps=1e-5, **common)
    if arch == "qwen2":
        from transformers import Qwen2Config

        common.pop("head_dim")
        return Qwen2Config(rms_norm_eps=1e-6, **common)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(rms_norm_eps=1e-6, **common)
    if arch == "gemma":
        from transformers import GemmaConfig

        common["tie_word_embeddings"] = True  # vLLM's Gemma, like every released Gemma, ties them
        return GemmaConfig(rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", **common)
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


MARKER = "layertap-tiny.json"


def _recipe(arch: str, num_layers: int, hidden_size: int, seed: int) -> dict:
    return {"recipe": RECIPE_VERSION, "arch": arch, "layers": num_layers, "hidden": hidden_size, "seed": seed}


def is_built(
    directory: str | os.PathLike, arch: str = "llama", num_layers: int = 4, hidden_size: int = 128, seed: int = 0
) -> bool:
    """Whether `build_tiny_model` with these arguments would reuse what `directory` holds."""
    marker = Path(directory) / MARKER
    return marker.is_file() and json.loads(marker.read_text()) == _recipe(arch, num_layers, hidden_size, seed)


def build_tiny_model(
    directory: str | os.PathLike,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 128,
    seed: int = 0,
) -> str:
    """Write a random `arch` model and its tokenizer to `directory` (reused when already built, without
    importing torch)."""
    target = Path(directory)
    recipe = _recipe(arch, num_layers, hidden_size, seed)
    if is_built(target, arch, num_layers, hidden_size, seed):
        return str(target)

    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _byte_level_tokenizer()
    config = _config(arch, len(tokenizer), num_layers, hidden_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps(recipe))
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return str(target)
