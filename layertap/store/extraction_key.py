"""The extraction key: what makes results comparable, and the id the store files them under."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from layertap.settings import stored_dtype_for


@dataclass(frozen=True)
class ExtractionKey:
    """What makes results comparable; `extraction_id` hashes the fields that change the vectors (model,
    pooling, dtype, normalisation rules and, when prompts are truncated, the length they are cut to)."""

    model_fingerprint: str
    model_path: str
    pooling: str
    dtype: str
    rules_id: str
    hidden_size: int
    num_layers: int
    truncate_to: int | None = None
    # The dtype the vectors are stored in; None: the engine dtype's default (`stored_dtype_for`).
    store_dtype: str | None = None

    @property
    def stored_dtype(self) -> str:
        return stored_dtype_for(self.dtype, self.store_dtype)

    @property
    def extraction_id(self) -> str:
        fields = {"model_fingerprint": self.model_fingerprint, "pooling": self.pooling, "dtype": self.dtype,
                  "rules_id": self.rules_id}
        if self.truncate_to is not None:  # only then: ids of extractions without truncation stay as they were
            fields["truncate_to"] = self.truncate_to
        if self.stored_dtype != stored_dtype_for(self.dtype):  # likewise for the default stored dtype
            fields["stored_dtype"] = self.stored_dtype
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]
