"""Shared-memory files that a killed attempt left in /dev/shm, removed before the next one starts.

MPICH's segments (mpich_shm_*) are named after the job and step, which a requeued job repeats: a
stale one makes the new attempt's MPI_Init fail ("failed to unpack address"). A file is stale when
it is this user's, no live process of this user has it mapped or open, and it is older than this
task's start: a live job's segments are mapped by its processes, and a segment a peer of this
launch has just made is younger than the launch. Every task sweeps before MPI_Init (tasks of a node
may sweep at once: a file already gone is fine). Torch-free, MPI-free.

vLLM's buffers (psm_*, Python's shared_memory, 160-250 MB each) and multiprocessing's semaphores
(sem.mp-*) block nothing, but a killed engine leaves them, and they hold the node's memory. Their
names are random, and other programs make the same kind: only the ones a server recorded as its
engine's (`record`) are removed, once no process maps them (`sweep_recorded`: every task at its
start, `hpcrl run` and the batch script after the run).

`python -m hpcrl.compute.launch.shm_sweep RUN_DIR` runs both sweeps on this host.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write

SHM_DIR = Path("/dev/shm")
PATTERNS = ("mpich_shm_*",)
ENGINE_PATTERNS = ("psm_", "sem.mp-")       # the engine's files a server records
MARGIN_S = 2.0        # a peer's segment made this long before our own start still counts as new


def _mapped(proc: Path, prefix: str) -> set[str]:
    """Names under the /dev/shm `prefix` that the process at /proc/<pid> `proc` maps."""
    names = set()
    for line in (proc / "maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5:]
        if path and path[0].startswith(prefix):
            names.add(path[0][len(prefix):].removesuffix(" (deleted)"))
    return names


def _children() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def mapped_by(pids, shm_dir: Path = SHM_DIR) -> list[str]:
    """Names under `shm_dir` that the processes `pids`, or any process they started, map."""
    prefix, names, todo, seen, children = str(shm_dir) + "/", set(), list(pids), set(), _children()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
        try:
            names |= _mapped(Path(f"/proc/{pid}"), prefix)
        except OSError:
            continue
    return sorted(n for n in names if (shm_dir / n).exists())


def record(path: Path, names: list[str]) -> None:
    """Keep an engine's shared-memory file names (rundir.engine_shm_record) for sweep_recorded."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"host": socket.gethostname(), "files": names}))


def _in_use(shm_dir: Path) -> set[str]:
    """Names under `shm_dir` that a process of this user maps or holds open."""
    prefix, uid, used = str(shm_dir) + "/", os.getuid(), set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            used |= _mapped(proc, prefix)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:             # gone meanwhile, or not ours to read
            continue
    return used


def _in_use_once(shm_dir: Path) -> Callable[[], set[str]]:
    """`_in_use`, scanned at the first call only: a sweep with no candidate scans no process."""
    return functools.cache(lambda: _in_use(shm_dir))


def sweep_recorded(run_dir: str | os.PathLike, shm_dir: Path = SHM_DIR,
                   in_use: Callable[[], set[str]] | None = None) -> list[str]:
    """Remove the files this host's engines of the run recorded, where no process maps them any more;
    a record whose files are all gone goes too."""
    in_use = in_use or _in_use_once(shm_dir)
    host, removed = socket.gethostname(), []
    for path in sorted((Path(run_dir) / rundir.SERVERS_DIR).glob("shm-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("host") != host:
            continue
        left = []
        for name in data.get("files", []):
            f = shm_dir / Path(name).name
            if not f.exists():
                continue
            if name in in_use():
                left.append(name)
                continue
            try:
                f.unlink()
                removed.append(name)
            except OSError:
                left.append(name)
        if not left:
            path.unlink(missing_ok=True)
    return removed


def sweep(started_at: float | None = None, shm_dir: Path = SHM_DIR,
          in_use: Callable[[], set[str]] | None = None) -> list[str]:
    """Remove this user's stale shared-memory files; returns their names."""
    if not shm_dir.is_dir():
        return []
    in_use = in_use or _in_use_once(shm_dir)
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
    removed = []
    for f in candidates:
        if f.name in in_use():
            continue
        try:
            f.unlink()
            removed.append(f.name)
        except OSError:
            continue
    return removed


def sweep_run(run_dir: str | os.PathLike, shm_dir: Path = SHM_DIR) -> list[str]:
    """Both sweeps for a run on this host, with one scan of the processes."""
    in_use = _in_use_once(shm_dir)
    return sweep_recorded(run_dir, shm_dir, in_use) + sweep(shm_dir=shm_dir, in_use=in_use)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpcrl.compute.launch.shm_sweep RUN_DIR", file=sys.stderr)
        return 2
    removed = sweep_run(args[0])
    if removed:
        print(f"hpcrl: removed {len(removed)} shared-memory file(s) a killed run left in /dev/shm on "
              f"{socket.gethostname()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
