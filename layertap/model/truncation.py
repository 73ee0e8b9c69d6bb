"""Opt-in truncation of prompts longer than the model's context.

By default an over-long prompt is rejected with its length as the reason. With truncation on, it is cut
to its first `truncate_to` tokens and embedded, and the ledger says so. The length is part of the
extraction key, so truncated and untruncated results never mix.
"""

from __future__ import annotations

from layertap.errors import InputError
from layertap.model.fingerprint import ModelInfo, read_model_info


def truncation_length(
    model_dir: str, truncate: bool, max_model_len: int | None, info: ModelInfo | None = None
) -> int | None:
    """Tokens a prompt is cut to (the engine's context), or None when truncation is off; `info` is the
    model's, when already read."""
    if not truncate:
        return None
    length = max_model_len or (info or read_model_info(model_dir)).max_position_embeddings
    if not length:
        raise InputError(
            f"truncate: {model_dir} does not state its context length (max_position_embeddings); "
            "set max_model_len (--max-model-len or LAYERTAP_MAX_MODEL_LEN)"
        )
    return int(length)


def truncation_note(tokens: int, truncate_to: int) -> str:
    return f"truncated: {tokens} tokens cut to {truncate_to}"
