"""A run's options worked out once against its model folder: the model's shape and fingerprint, the layers
resolved to indices, the length prompts are cut to, the extraction key and the engine options.

Every stage after the preflight (registering the extraction, planning, extracting, checking, the finish
from the store alone) takes this one object, so the layer list is parsed and resolved once and config.json
and the model's files are read once per run. It holds no arrays: Prefect passes it between tasks as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from layertap.model.fingerprint import ModelInfo, check_model_folder, fingerprint_model
from layertap.model.layers import resolve_layers
from layertap.model.truncation import truncation_length
from layertap.runner.engine_options import EngineOptions
from layertap.settings import Settings
from layertap.store.extraction_key import ExtractionKey
from layertap.store.normalise import NormaliseRules


@dataclass(frozen=True)
class PreparedRun:
    """The run's settings (its model an absolute folder) and what follows from them and the model."""

    settings: Settings
    model: ModelInfo
    key: ExtractionKey
    # Hugging Face hidden-state indices, sorted and unique, each in 0..num_layers.
    layers: list[int] = field(default_factory=list)

    @property
    def extraction_id(self) -> str:
        return self.key.extraction_id

    @property
    def rules_id(self) -> str:
        return self.key.rules_id

    @property
    def hidden_size(self) -> int:
        return self.key.hidden_size

    @property
    def truncate_to(self) -> int | None:
        return self.key.truncate_to

    @property
    def stored_dtype(self) -> str:
        return self.key.stored_dtype

    def engine_options(self) -> EngineOptions:
        """The options the run's engine is started with."""
        return EngineOptions(model=self.key.model_path, dtype=self.settings.dtype, **self.settings.engine_options())

    def with_settings(self, **changes) -> PreparedRun:
        """The same run with some settings changed that do not change the model, layers or key (engine
        placement, executor)."""
        return PreparedRun(self.settings.model_copy(update=changes), self.model, self.key, self.layers)


def prepare_run(settings: Settings, model_dir: str | None = None) -> PreparedRun:
    """Read the model folder (`model_dir`, else `settings.model`) once: check it, fingerprint it, resolve
    the layers and the truncation length against it. Raises the preflight's one-line errors."""
    given = model_dir or settings.model
    info = check_model_folder(given, settings.load_format)  # its errors name the folder as given
    model = str(Path(given).expanduser().resolve())
    layers = resolve_layers(settings.layer_spec(), info.num_layers)
    key = ExtractionKey(
        model_fingerprint=fingerprint_model(model), model_path=model, pooling=settings.pooling,
        dtype=settings.dtype, rules_id=NormaliseRules(remove_period=settings.remove_period).rules_id,
        hidden_size=info.hidden_size, num_layers=info.num_layers,
        truncate_to=truncation_length(model, settings.truncate, settings.max_model_len, info),
        store_dtype=settings.store_dtype,
    )
    return PreparedRun(settings.model_copy(update={"model": model}), info, key, layers)
