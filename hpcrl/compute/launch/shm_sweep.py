"""Shared-memory files that a killed attempt left in /dev/shm, removed before the next one starts.

MPICH's segments (mpich_shm_*) are named after the job and step, which a requeued job repeats: a
stale one makes the new attempt's MPI_Init fail ("failed to unpack address"). A file is stale when
it is this user's, no live process of this user has it mapped or open, and it is older than this
task's start: a live job's segments are mapped by its processes, and a segment a peer of this
launch has just made is younger than the launch. Every task sweeps before MPI_Init (tasks of a node
may sweep at once: a file already gone is fine). Torch-free, MPI-free.

Not swept: vLLM's psm_* (Python's shared_memory) and multiprocessing's sem.mp-* semaphores. They
block nothing, and their creators unlink them themselves at exit: on the testbed a sweep of
sem.mp-* once took one that a live process still meant to unlink (its exit then failed on it). A
killed attempt's psm_* stay until the node's epilog or a reboot clears /dev/shm.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PATTERNS = ("mpich_shm_*",)
MARGIN_S = 2.0        # a peer's segment made this long before our own start still counts as new


def _in_use(shm_dir: Path) -> set[str]:
    """Names under `shm_dir` that a process of this user maps or holds open."""
    prefix, uid, used = str(shm_dir) + "/", os.getuid(), set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5:]
                if path and path[0].startswith(prefix):
                    used.add(path[0][len(prefix):].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:             # gone meanwhile, or not ours to read
            continue
    return used


def sweep(started_at: float | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove this user's stale shared-memory files; returns their names."""
    if not shm_dir.is_dir():
        return []
    cutoff = (time.time() if started_at is None else started_at) - MARGIN_S
    uid = os.getuid()
    candidates = []
    for pattern in PATTERNS:
        for f in shm_dir.glob(pattern):
            try:
                st = f.stat()
            except OSError:
                continue
            if st.st_uid == uid and st.st_mtime < cutoff:
                candidates.append(f)
    if not candidates:
        return []
    used = _in_use(shm_dir)
    removed = []
    for f in candidates:
        if f.name in used:
            continue
        try:
            f.unlink()
            removed.append(f.name)
        except OSError:
            continue
    return removed
