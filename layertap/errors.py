"""Errors layertap raises on purpose; the CLI prints them as one line."""


class LayertapError(Exception):
    """Base class: a clear, user-facing reason."""


class StoreError(LayertapError):
    """The store is missing, locked, or was made by another version."""


class StoreUnwritable(StoreError):
    """The store cannot take the run's output (its disk is full, or it is read-only): retrying cannot help."""


class InputError(LayertapError):
    """An input file, column or setting is unusable."""


class ModelUnusable(InputError):
    """The model folder is missing, or lacks its config, weights or tokenizer: retrying cannot help."""


class EngineError(LayertapError):
    """The extraction engine cannot run or produced something unusable."""


class ValidationError(LayertapError):
    """Extracted vectors failed a check; the batch is not published."""


class OutOfDeviceMemory(EngineError):
    """The device ran out of memory in a runner's own process (its torch.OutOfMemoryError, carried across):
    the batch was too big for the device right now, so callers split it, as for the error itself."""
