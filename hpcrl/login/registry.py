"""The login-node job registry: which jobs hpcrl submitted, where their run directories are, and
the last state Slurm reported (so `hpcrl status` can still show something when slurmctld is down).

One SQLite file, default $HPCRL_HOME/registry.sqlite (HPCRL_HOME defaults to ~/.local/share/hpcrl).
Two hpcrl commands may run at once (a `status` during a `submit`): every write is one short
IMMEDIATE transaction and readers wait on a busy timeout instead of failing with "database is locked".
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcrl.job.errors import UserError

__all__ = ["Record", "Registry", "RegistryError", "default_path"]

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0

# Filesystems where SQLite's WAL mode is unsafe: WAL keeps its index in shared memory, which only
# works between processes on one host, and $HOME on clusters is often shared by all login nodes.
_NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs",
               "fuse.sshfs", "fuse.ceph", "fuse.glusterfs", "panfs", "wekafs", "9p")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id        TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    site          TEXT NOT NULL,
    run_dir       TEXT NOT NULL,
    script_path   TEXT NOT NULL,
    submitted_at  REAL NOT NULL,   -- unix seconds
    last_state    TEXT,            -- JSON of slurm.JobInfo.to_dict() (+ "shown": hpcrl.login.status)
    state_seen_at REAL             -- unix seconds when Slurm reported last_state
);
CREATE INDEX IF NOT EXISTS jobs_by_time ON jobs (submitted_at);
"""


class RegistryError(UserError):
    """The registry file cannot be used (written by a newer hpcrl, not a database, truncated...): the
    user's to fix (cli.main prints the message, exit 2), so the message says how."""


def _unusable(path: Path, e: sqlite3.DatabaseError) -> RegistryError:
    if "locked" in str(e):
        return RegistryError(f"{path}: {e} (another hpcrl command held it for {BUSY_TIMEOUT_S:.0f} s); try again")
    return RegistryError(f"{path}: not a usable hpcrl job registry ({e}); move it aside (mv {path} {path}.broken) "
                         f"and hpcrl starts an empty one, or set HPCRL_HOME to keep the registry elsewhere")


def _reported(method):
    """A method whose sqlite3 errors become RegistryError: a file damaged past its first pages
    opens, and fails only on the read that reaches them."""
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as e:
            raise _unusable(self.path, e) from None
    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


class Record(namedtuple("Record", "job_id name site run_dir_text script_path_text submitted_at last_state "
                                  "state_seen_at", defaults=(None, None))):
    """One registered job: job_id, name, site, run_dir and script_path (Paths), submitted_at (unix s),
    last_state (JobInfo.to_dict(), or None before Slurm was first asked) and state_seen_at (unix s).

    A named tuple, not a dataclass: importing dataclasses costs `hpcrl status` ~8 ms of its budget.
    The paths are kept as text and made Paths when asked for: a 1,000-job list would make 2,000
    Paths (~3 ms) and needs only the run directory's text."""

    __slots__ = ()

    @property
    def run_dir(self) -> Path:
        return Path(self.run_dir_text)

    @property
    def script_path(self) -> Path:
        return Path(self.script_path_text)


def default_path() -> Path:
    home = os.environ.get("HPCRL_HOME") or Path.home() / ".local" / "share" / "hpcrl"
    return Path(home) / "registry.sqlite"


def _on_network_fs(path: Path, mounts_file: str = "/proc/mounts") -> bool:
    """Whether path lies on a network filesystem, judged from the longest matching mount point."""
    try:
        with open(mounts_file) as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return False   # not Linux: assume local
    path_s = str(path.resolve())
    best, fstype = "", ""
    for mnt, typ in mounts:
        mnt = mnt.replace("\\040", " ")
        if (path_s == mnt or path_s.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
            best, fstype = mnt, typ
    return fstype in _NETWORK_FS


class Registry:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # autocommit mode (isolation_level=None): we open transactions ourselves, and keep them short
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            self._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._set_journal_mode("DELETE" if _on_network_fs(self.path.parent) else "WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            # A table of another shape (another program's file, a hand edit) fails here, before
            # `submit` has handed Slurm a job it could then not register.
            self._db.execute(f"SELECT {_COLUMNS} FROM jobs LIMIT 0")
        except (sqlite3.DatabaseError, RegistryError) as e:
            self._db.close()
            raise e if isinstance(e, RegistryError) else _unusable(self.path, e) from None

    def _set_journal_mode(self, mode: str) -> None:
        """Changing the journal mode needs an exclusive lock, and SQLite answers "database is
        locked" at once, without the busy handler, when another process opens the same new
        registry at that moment: retry within the busy timeout."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                if self._db.execute("PRAGMA journal_mode").fetchone()[0].upper() != mode:
                    self._db.execute(f"PRAGMA journal_mode = {mode}")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _migrate(self) -> None:
        # Read first: every `hpcrl status` opens the registry, and an up-to-date one needs no write.
        if self._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            return
        with self._write():
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RegistryError(f"{self.path}: schema version {version} is newer than this hpcrl "
                                    f"understands ({SCHEMA_VERSION}); upgrade hpcrl")
            if version < 1:
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        self._db.execute(stmt)
            # later versions: `if version < 2: ALTER TABLE ...` here, in order
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @contextmanager
    def _write(self) -> Iterator[None]:
        # IMMEDIATE takes the write lock up front, so two writers queue on the busy timeout
        # instead of one failing ("database is locked") when it upgrades a read lock.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ------------------------------------------------------------------------------ API

    @_reported
    def add(self, job_id: str, name: str, site: str, run_dir: str | Path, script_path: str | Path,
            submitted_at: float | None = None) -> Record:
        """Record a submitted job. A job id already present is replaced: Slurm reuses ids when a
        cluster's state is reset, and the newer job is the one that exists now."""
        rec = Record(str(job_id), name, site, str(Path(run_dir)), str(Path(script_path)),
                     time.time() if submitted_at is None else float(submitted_at))
        with self._write():
            self._db.execute("INSERT OR REPLACE INTO jobs (job_id, name, site, run_dir, script_path, "
                             "submitted_at) VALUES (?, ?, ?, ?, ?, ?)",
                             (rec.job_id, rec.name, rec.site, rec.run_dir_text, rec.script_path_text,
                              rec.submitted_at))
        return rec

    @_reported
    def get(self, job_id: str) -> Record | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE job_id = ?", (str(job_id),)).fetchone()
        return _record(row) if row else None

    @_reported
    def list(self, limit: int | None = None) -> list[Record]:
        """Newest submission first."""
        sql = f"SELECT {_COLUMNS} FROM jobs ORDER BY submitted_at DESC, rowid DESC"
        rows = self._db.execute(sql + " LIMIT ?", (limit,)) if limit is not None else self._db.execute(sql)
        return [_record(r) for r in rows]

    def update_state(self, job_id: str, info: dict, seen_at: float | None = None) -> bool:
        """Store Slurm's last word on a job. An answer older than the stored one is ignored, so two
        `status` commands racing cannot roll a job back to RUNNING. False if the job is not known
        (or the update was older)."""
        return bool(self.update_states({job_id: info}, seen_at))

    @_reported
    def update_states(self, infos: dict[str, dict], seen_at: float | None = None) -> list[str]:
        """update_state for many jobs in one transaction: one commit (one journal sync where the
        registry lives on a network filesystem) for a `status` of 1,000 jobs, not 1,000. Returns
        the ids updated."""
        seen_at = time.time() if seen_at is None else float(seen_at)
        updated = []
        with self._write():
            for job_id, info in infos.items():
                cur = self._db.execute(
                    "UPDATE jobs SET last_state = ?, state_seen_at = ? "
                    "WHERE job_id = ? AND (state_seen_at IS NULL OR state_seen_at <= ?)",
                    (json.dumps(info, sort_keys=True), seen_at, str(job_id), seen_at))
                if cur.rowcount > 0:
                    updated.append(str(job_id))
        return updated

    @_reported
    def amend_states(self, states: dict[str, tuple[dict, float]]) -> list[str]:
        """Replace stored states, {job_id: (info, seen_at)}, where the stored one is still the one
        Slurm reported at seen_at (not re-registered or updated since); state_seen_at is kept.
        One transaction. Returns the ids amended."""
        amended = []
        with self._write():
            for job_id, (info, seen_at) in states.items():
                cur = self._db.execute("UPDATE jobs SET last_state = ? WHERE job_id = ? AND state_seen_at = ?",
                                       (json.dumps(info, sort_keys=True), str(job_id), seen_at))
                if cur.rowcount > 0:
                    amended.append(str(job_id))
        return amended

    @_reported
    def remove(self, job_id: str) -> bool:
        with self._write():
            cur = self._db.execute("DELETE FROM jobs WHERE job_id = ?", (str(job_id),))
        return cur.rowcount > 0

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *_) -> None:
        self.close()


_COLUMNS = "job_id, name, site, run_dir, script_path, submitted_at, last_state, state_seen_at"


def _record(row: tuple) -> Record:
    job_id, name, site, run_dir, script, submitted, state, seen = row
    return Record(job_id, name, site, run_dir, script, submitted,
                  json.loads(state) if state else None, seen)
