"""Whether the store's disk can take a run's output, before and while it is written.

A full disk or a store the user cannot write to does not heal when a batch is retried, so such failures stop
the run with one line naming the cause instead of being retried and quarantined; a run whose output cannot
fit is refused before its engine starts.
"""

from __future__ import annotations

import errno
import os
import shutil

from layertap.errors import StoreUnwritable

_DOES_NOT_HEAL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def as_unwritable(exc: OSError, store: str | os.PathLike) -> StoreUnwritable | None:
    """The one-line error for a write that failed for good (full disk, read-only store), or None."""
    if exc.errno not in _DOES_NOT_HEAL:
        return None
    where = f" ({exc.filename})" if exc.filename else ""
    return StoreUnwritable(f"store {store}: {exc.strerror}{where}; free space or make it writable, then rerun")


def check_room(store: str | os.PathLike, vectors: int, hidden_size: int, value_bytes: int) -> None:
    """Refuse a run whose `vectors` (prompt x layer), before compression, would not fit in the store's free
    space."""
    need = vectors * hidden_size * value_bytes
    free = shutil.disk_usage(store).free
    if need > free:
        raise StoreUnwritable(
            f"store {store}: {free / 1e9:.2f} GB free, but this run writes up to {need / 1e9:.2f} GB "
            f"({vectors} vectors (prompt x layer) x {hidden_size} values x {value_bytes} bytes); "
            "free space, or choose fewer layers or another store"
        )
