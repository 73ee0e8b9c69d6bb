"""How the store creates files and folders: the user's umask decides, but nothing is ever world-writable.

Files are created with mode 0o664 and folders with 0o775 before the umask applies, so a umask of 077
gives private files and the usual 022 or 002 gives readable ones, while even a umask of 000 cannot let
other users rewrite results. DuckDB creates its database file itself, so that one is corrected after.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

FILE_MODE = 0o664
DIR_MODE = 0o775


def make_dirs(path: str | os.PathLike) -> Path:
    """mkdir -p with DIR_MODE (parents created here get the same mode)."""
    target = Path(path)
    missing, folder = [], target
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
    return target


def create_file(path: str | os.PathLike, flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL) -> int:
    """os.open with FILE_MODE: the descriptor of a new file."""
    return os.open(path, flags, FILE_MODE)


def drop_world_write(path: str | os.PathLike) -> None:
    """Remove write permission for others from a file someone else created for us (e.g. DuckDB)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if mode & stat.S_IWOTH:
        os.chmod(path, stat.S_IMODE(mode) & ~stat.S_IWOTH)
