"""What every extraction engine returns, so the pipeline does not care which one ran."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

POOLINGS = ("last", "mean")


@dataclass
class Extraction:
    """Pooled vectors for the kept prompts of one call.

    `vectors[layer]` is an array [len(kept), hidden] in the engine's precision (float32, float16, or
    bfloat16 patterns: `layertap.parts.bfloat16.as_float32` reads any of them); row i belongs to texts[kept[i]].
    `rejected` maps an input position to the reason it was not embedded (e.g. longer than the model allows).
    `truncated` maps an input position that was cut to fit to its original token count.
    The vectors may live in a buffer the engine reuses: call `release()` once they are written. `buffer` is
    that buffer's file when it is shared memory another process can map (`runner_process`).
    """

    vectors: dict[int, np.ndarray]
    kept: list[int]
    rejected: dict[int, str] = field(default_factory=dict)
    num_tokens: int = 0
    truncated: dict[int, int] = field(default_factory=dict)
    release_fn: Callable[[], None] | None = field(default=None, repr=False)
    buffer: str | None = None

    def release(self) -> None:
        """Hand the vectors' memory back for reuse; `vectors` is emptied so nothing reads it afterwards."""
        self.vectors = {}
        release, self.release_fn = self.release_fn, None
        if release is not None:
            release()


@dataclass
class EngineActivity:
    """What the engine thread has done since the engine started: engine steps taken and the seconds spent in
    them, and the seconds it waited with no prompt to compute. Idle time during a run means the engine
    waited for the caller (the host's work on earlier batches), not the other way round. `in_engine` is a
    reading, not a count: the prompts handed to vLLM and not yet finished; when it falls below a step's worth
    the engine runs short steps."""

    steps: int = 0
    stepping_s: float = 0.0
    idle_s: float = 0.0
    in_engine: int = 0

    def since(self, earlier: EngineActivity | None) -> EngineActivity:
        """What the engine thread did between `earlier` (None: the engine's start) and this reading."""
        earlier = earlier or EngineActivity()
        return EngineActivity(self.steps - earlier.steps, self.stepping_s - earlier.stepping_s,
                              self.idle_s - earlier.idle_s, self.in_engine)


class Runner(Protocol):
    """An engine that pools hidden states of chosen layers (Hugging Face indices) for a list of texts."""

    num_layers: int
    hidden_size: int

    def extract(self, texts: list[str], layers: list[int], pooling: str) -> Extraction: ...

    def close(self) -> None: ...
