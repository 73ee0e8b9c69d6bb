"""Identify a model folder by content, cheaply enough to run on every flow run.

Small files (config, tokenizer, index files) are hashed whole. Weight files can be many gigabytes, so
they are identified by size, modification time and a SHA-256 over 16 spread 1 MiB samples: rewriting
or replacing weights changes the fingerprint, and a 14 GB model fingerprints in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from layertap.errors import ModelUnusable

WHOLE_FILE_LIMIT = 64 * 2**20
SAMPLES = 16
SAMPLE_BYTES = 2**20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# A tokenizer in any of the forms transformers loads; a folder with none of them cannot tokenise prompts.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class ModelInfo:
    """The shape facts layertap needs before starting an engine."""

    model_type: str
    num_layers: int
    hidden_size: int
    max_position_embeddings: int | None


def _text_config(config: dict) -> dict:
    """Multimodal configs nest the language model's settings under text_config."""
    return config.get("text_config") or config


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Read layer count and hidden size from config.json, with a clear error when it is missing."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelUnusable(f"model: {model_dir} has no config.json (not a Hugging Face model folder)")
    try:
        config = _text_config(json.loads(path.read_text()))
        return ModelInfo(
            model_type=str(config.get("model_type", "unknown")),
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            max_position_embeddings=config.get("max_position_embeddings"),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelUnusable(f"model: {path} lacks a usable num_hidden_layers/hidden_size ({exc})") from None


def check_model_folder(model_dir: str | os.PathLike, load_format: str | None = None) -> ModelInfo:
    """Everything an engine needs from the folder before it starts: the folder, its config, weight files (unless
    the engine makes random ones, `load_format="dummy"`) and a tokenizer. A missing piece is `ModelUnusable`,
    one line naming it: no retry or new engine brings it back."""
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise ModelUnusable(f"model: {model_dir} is not a folder" + ("" if root.exists() else " (it does not exist)"))
    info = read_model_info(root)
    files = [p for p in root.iterdir() if p.is_file()]
    if load_format != "dummy" and not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ModelUnusable(f"model: {model_dir} has no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})")
    if not any(p.name in TOKENIZER_FILES or p.suffix == ".tiktoken" for p in files):
        raise ModelUnusable(f"model: {model_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)} or *.tiktoken)")
    return info


def safetensors_header(handle) -> tuple[dict, int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets; its metadata left out) and the
    offset their data starts at, read from the file's head."""
    size = int.from_bytes(handle.read(8), "little")
    header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def parameter_count(model_dir: str | os.PathLike) -> int | None:
    """How many weights the folder's safetensors files hold, read from their headers alone; None when it has
    none (weights in another format, or a folder that only has a config)."""
    total, files = 0, sorted(Path(model_dir).glob("*.safetensors"))
    for path in files:
        with path.open("rb") as handle:
            header, _ = safetensors_header(handle)
        total += sum(math.prod(entry["shape"]) for entry in header.values())
    return total if files else None


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        if size <= WHOLE_FILE_LIMIT:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for i in range(SAMPLES):
                handle.seek(i * step)
                digest.update(handle.read(SAMPLE_BYTES))
            digest.update(f"{size}:{path.stat().st_mtime_ns}".encode())
    return digest.hexdigest()


def fingerprint_model(model_dir: str | os.PathLike) -> str:
    """SHA-256 over every file of the model folder that can change its outputs."""
    root = Path(model_dir)
    read_model_info(root)  # fail early and clearly on a folder that is not a model
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue
        if path.suffix in WEIGHT_SUFFIXES or path.suffix in (".json", ".model", ".txt", ".py", ".tiktoken"):
            digest.update(f"{rel}\0{_file_digest(path)}\0".encode())
    return digest.hexdigest()
