"""A whole-file write that a reader never sees half done, for both sides: the text or bytes go to a
temporary file beside ``path`` (a unique name, so that concurrent writers never share one) and
replace ``path`` in one rename. A failed write removes its temporary and leaves ``path`` as it was.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir"]


def atomic_write(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o644, durable: bool = False) -> None:
    """Replace ``path`` with ``data``; its permission bits are ``mode``. ``durable``: the file and
    the rename are on disk (fsync of both) before this returns, for what a crash must not lose."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """A directory's entries (a rename, a new file) on disk; a file system that cannot sync a
    directory has nothing more to give."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
