"""Hugging Face reference engine: `output_hidden_states=True`, one prompt at a time.

It is the yardstick the vLLM runner is checked against (the parity sample), so it is deliberately the
plainest possible code: no padding, no batching tricks, the model's own forward.
"""

from __future__ import annotations

import gc
import logging
import mmap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from layertap.errors import EngineError
from layertap.model.fingerprint import parameter_count, read_model_info, safetensors_header
from layertap.runner.base import POOLINGS, Extraction
from layertap.settings import DTYPE_BYTES

log = logging.getLogger(__name__)

# GPU memory the reference needs beyond its weights: one short prompt's activations, the allocator's slack.
REFERENCE_SLACK_BYTES = 2 * 2**30
# What the engine's default share leaves free beyond that: the CUDA context of the process computing the
# reference, and what vLLM holds beyond its share (on an H100 with a 7B model, leaving exactly the
# reference's bytes left it 0.1 GB short).
ENGINE_MARGIN_BYTES = 3 * 2**30
# A reference on the CPU whose weights take at most this much host memory stays loaded beside its engine.
KEEP_ON_HOST_BYTES = 256 * 2**20
# Tensors copied at once while loading: page faults and host-to-device copies overlap, and host memory
# maps no more than these few tensors.
LOAD_THREADS = 4


# safetensors' dtype names.
_STORED = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
           "I32": "int32", "U8": "uint8", "I8": "int8", "BOOL": "bool"}


def _load_model(model: str, dtype, device: str, trust_remote_code: bool):
    """The model built on `device` from its config, then its weights copied into place from the folder's
    safetensors files, a few tensors at a time: host memory never holds the whole model (a 7B model's
    reference is built on the GPU beside a running engine). Folders in another format, or whose
    names do not match the model's own, load through `from_pretrained` instead."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with torch.device(device):
        built = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if _read_weights_into(built, sorted(Path(model).glob("*.safetensors"))):
        return built
    del built
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, trust_remote_code=trust_remote_code).to(device)


def _read_weights_into(built, files: list[Path]) -> bool:
    """Copy every tensor of `files` into the parameter of the same name; False (and stop) at a name or type
    the model lacks, or when some parameter got no tensor (tied ones count as loaded with their twin).

    Each tensor is mapped from its file, copied into place and unmapped: it goes from the page cache (where
    the engine's own load left it) to its parameter in one copy, a few tensors at a time, and host memory
    never holds more than those few."""
    import torch

    params = dict(built.named_parameters())
    jobs = []
    for path in files:
        with path.open("rb") as handle:
            header, base = safetensors_header(handle)
        if any(name not in params or entry["dtype"] not in _STORED for name, entry in header.items()):
            return False
        jobs += [(path, params[name], base + entry["data_offsets"][0], base + entry["data_offsets"][1],
                  getattr(torch, _STORED[entry["dtype"]]), entry["shape"]) for name, entry in header.items()]

    def copy(job) -> None:
        path, param, start, end, dtype, shape = job
        if end == start:  # an empty tensor: nothing to map
            return
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), end - aligned, offset=aligned,
                                                  access=mmap.ACCESS_COPY) as mapped:
            raw = np.frombuffer(mapped, np.uint8, end - start, start - aligned)
            with torch.no_grad():
                param.copy_(torch.from_numpy(raw).view(dtype).reshape(shape))
            del raw  # no view may outlive the mapping

    with ThreadPoolExecutor(max_workers=LOAD_THREADS) as pool:
        list(pool.map(copy, jobs))
    loaded = {id(param) for _, param, *_ in jobs}
    return bool(files) and all(id(p) in loaded for p in params.values())


class HfRunner:
    """Pools hidden states with transformers on CPU (or `device`), for parity checks and as a fallback."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
        import torch
        from transformers import AutoTokenizer

        info = read_model_info(model)
        self.num_layers, self.hidden_size = info.num_layers, info.hidden_size
        self.device, self.dtype = device, dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        self.model = _load_model(model, getattr(torch, dtype), device, trust_remote_code).eval()

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

    def weight_bytes(self) -> int:
        """Bytes the loaded model's weights take."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def close(self) -> None:
        """Free the model's memory now, on the device too: the engine beside it keeps running."""
        self.model = None
        gc.collect()
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()


def reference_bytes(model: str, dtype: str, count: int | None = None) -> int | None:
    """Device memory the reference needs in `dtype`: its weights (`count` of them, else counted from the
    folder) plus slack; None when the folder's weights cannot be counted from their headers."""
    count = parameter_count(model) if count is None else count
    return None if count is None else count * DTYPE_BYTES[dtype] + REFERENCE_SLACK_BYTES


def reference_placement(model: str, engine_dtype: str) -> tuple[str, str]:
    """(device, dtype) of the parity reference: on the GPU in the engine's dtype when it fits in the memory
    free there (the engine's default share leaves that room: `vllm_runner.default_gpu_memory_share`), so a
    7B model's reference never needs 28 GB of host memory; otherwise on the CPU in float32."""
    import torch

    if torch.cuda.is_available():
        count = parameter_count(model)
        needed = reference_bytes(model, engine_dtype, count)
        free = torch.cuda.mem_get_info()[0]
        if needed is not None and needed <= free:
            return "cuda", engine_dtype
        log.warning("parity reference on the CPU in float32 (%s of host memory): the GPU has %.1f GB free, it "
                    "needs %s; a lower --gpu-memory-utilization leaves it room",
                    f"{count * 4 / 1e9:.1f} GB" if count else "the whole model", free / 1e9,
                    f"{needed / 1e9:.1f} GB" if needed else "an unknown amount (no safetensors weights)")
    return "cpu", "float32"


class ParityReference:
    """The parity sample's reference beside one engine: transformers' model, placed by `reference_placement`,
    loaded on the first call.

    With `keep`, it stays loaded for the engine's life when that costs the host nothing (on the GPU, in the
    room the engine's default share leaves it) or little (a small model on the CPU): a kept engine's later
    runs (a deployment's, triggered by new rows) check their sample without reading the weights again, 13 GB
    for a 7B model, which beside a busy engine also competes with the run's Parquet encoding for the host's
    memory bandwidth. A large model on the CPU (float32, 28 GB for a 7B model) is freed after each call."""

    def __init__(self, model: str, engine_dtype: str = "float32", keep: bool = True):
        self.model, self.engine_dtype, self.keep = model, engine_dtype, keep
        self.loads = 0  # how many times the weights were read
        self._loaded: HfRunner | None = None
        self._trust: bool | None = None
        self._lock = threading.Lock()

    def vectors(self, texts: list[str], layers: list[int], pooling: str,
                trust_remote_code: bool = False) -> dict[int, np.ndarray]:
        """`texts` pooled by transformers at `layers`, one float32 row per text."""
        with self._lock:
            started, fresh = time.monotonic(), self._loaded is None or self._trust != trust_remote_code
            if fresh:
                self._release()
                device, dtype = reference_placement(self.model, self.engine_dtype)
                self._loaded = HfRunner(self.model, dtype, device, trust_remote_code=trust_remote_code)
                self._trust = trust_remote_code
                self.loads += 1
            reference, loaded = self._loaded, time.monotonic()
            try:
                return reference.extract(texts, layers, pooling).vectors
            finally:
                if not (self.keep and _worth_keeping(reference)):
                    self._release()
                log.info("parity reference on %s in %s: model %s, %d prompts in %.1f s",
                         reference.device, reference.dtype,
                         f"loaded in {loaded - started:.1f} s" if fresh else "kept from an earlier run",
                         len(texts), time.monotonic() - loaded)

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def close(self) -> None:
        """Free the model's memory (the engine it served is closing)."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self._loaded is not None:
            self._loaded.close()
            self._loaded = None


def _worth_keeping(reference: HfRunner) -> bool:
    """Whether keeping `reference` loaded costs the host little: on a device, or small."""
    return reference.device != "cpu" or reference.weight_bytes() <= KEEP_ON_HOST_BYTES


def hf_reference(
    model: str, texts: list[str], layers: list[int], pooling: str, trust_remote_code: bool = False,
    engine_dtype: str = "float32",
) -> dict[int, np.ndarray]:
    """`texts` pooled by transformers, placed by `reference_placement`: the parity sample's reference, with
    the model loaded for this call only (`ParityReference` keeps it beside an engine).

    It runs in the asking process (on a GPU, the one driving the engine), which keeps the CUDA context for
    the rest of its life. A spawned child per call would start an interpreter, a context and the weights
    again for every run: 12 to 14 s on an H100 beside a 7B engine, holding the run back, and its 1.2 GB lie
    inside the run's memory peak anyway. In vLLM's worker, which has a context already, it would share one
    interpreter lock with the engine core's busy loop: beside a busy 7B engine it took 11 s and slowed the
    engine's steps (README, performance)."""
    return ParityReference(model, engine_dtype, keep=False).vectors(texts, layers, pooling, trust_remote_code)
