"""What a run reports while it trains: ``metrics.jsonl`` (one line per step) and ``heartbeat.json``.

Only trainer rank 0 writes (on other ranks every method is a no-op, so callers need no ``if``).

- ``<run_dir>/metrics.jsonl``: one JSON object per optimizer step, appended, flushed and fsynced
  line by line, so a killed job keeps every step it finished. On resume, :meth:`MetricsWriter.truncate_after`
  drops the lines past the checkpoint's step, so that each step appears exactly once.
- ``<run_dir>/completions.jsonl`` (recipe logging.log_completions): one JSON object per completion
  (step, prompt, completion, rewards by function, advantage), as TRL's completions table; a resume
  cuts it after the checkpoint's step too.
- ``<run_dir>/heartbeat.json``: rewritten atomically (temp file + ``os.replace``), so a reader
  (``hpcrl status``) always sees a whole file: time, step, phase, pid, host, and per-node server health.
- Optional TensorBoard (``torch.utils.tensorboard``, only if ``tensorboard`` is installed) and W&B in
  offline mode (only if ``wandb`` is installed); either missing gives a one-line warning. Both get
  the names transformers gives TRL's metrics there (``train/reward``, ``eval/reward``).

Importable without torch (the login side reads the same file names).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from hpcrl.job.atomic import atomic_write
from hpcrl.job.metric_keys import STEP, SYNC_S, TIME, TIME_SYNC_S, dashboard_key
from hpcrl.job.rundir import COMPLETIONS_FILE, HEARTBEAT_FILE, METRICS_FILE, TENSORBOARD_DIR

log = logging.getLogger(__name__)



def _plain(value: Any) -> Any:
    """JSON-safe: tensors/numpy scalars -> numbers, non-finite floats -> None (strict JSON has no NaN)."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class MetricsWriter:
    """Per-step metrics and the heartbeat of one run; active on trainer rank 0 only.

    ``tensorboard``/``wandb``: also log there (``<run_dir>/tensorboard``, ``<run_dir>/wandb`` offline),
    if the package is importable. ``config``: a plain dict W&B records with the run.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, *, tensorboard: bool = False, wandb: bool = False,
                 run_name: Optional[str] = None, config: Optional[Mapping[str, Any]] = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.active = rank == 0
        self.metrics_path = self.run_dir / METRICS_FILE
        self.completions_path = self.run_dir / COMPLETIONS_FILE
        self.heartbeat_path = self.run_dir / HEARTBEAT_FILE
        self._lock = threading.Lock()
        self._file = None
        self._host = socket.gethostname()
        self._want_tb = tensorboard
        self._want_wandb = wandb
        self._run_name = run_name
        self._config = dict(config or {})
        self._tb = None
        self._wandb = None
        self._purge_step: Optional[int] = None
        self._backends_started = False
        if self.active:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    # -- metrics.jsonl ------------------------------------------------------------------------

    def _open(self):
        if self._file is None:
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        return self._file

    def log(self, step: int, metrics: Mapping[str, Any]) -> Optional[dict]:
        """Append one line for ``step`` (adds ``step``, ``time``; ``sync_s`` from ``time_sync_s``).

        Returns the record written (None off rank 0).
        """
        if not self.active:
            return None
        record: dict[str, Any] = {STEP: int(step), TIME: time.time()}
        record.update(_plain(dict(metrics)))
        record[STEP] = int(step)
        if SYNC_S not in record and TIME_SYNC_S in record:
            record[SYNC_S] = record[TIME_SYNC_S]
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            f = self._open()
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._log_backends(record)
        return record

    def truncate_after(self, step: int) -> int:
        """Drop lines with ``step`` > ``step`` (and torn lines, and earlier duplicates of a step).

        Call on resume from a checkpoint of ``step``, before logging. Returns the lines dropped.
        """
        if not self.active:
            return 0
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            try:
                lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                lines = []
            kept: dict[Any, str] = {}
            for i, line in enumerate(lines):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                s = rec.get("step") if isinstance(rec, dict) else None
                if isinstance(s, int) and s > step:
                    continue
                # The last line of a step wins; lines without a step keep their place.
                key = ("step", s) if isinstance(s, int) else ("line", i)
                kept.pop(key, None)
                kept[key] = line
            text = "".join(v + "\n" for v in kept.values())
            if lines or self.metrics_path.exists():
                atomic_write(self.metrics_path, text, durable=True)
            self._purge_step = step + 1
            self._truncate_completions(step)
        return len(lines) - len(kept)

    # -- completions.jsonl --------------------------------------------------------------------

    def log_completions(self, rows: list[Mapping[str, Any]]) -> None:
        """Append one generation's rows (logging.log_completions)."""
        if not self.active or not rows:
            return
        text = "".join(json.dumps(_plain(dict(row)), separators=(",", ":"), ensure_ascii=False, default=str) + "\n"
                       for row in rows)
        with self._lock, open(self.completions_path, "a", encoding="utf-8") as f:
            f.write(text)

    def _truncate_completions(self, step: int) -> None:
        # Rows come in step order, and the file can be large: cut it at the first row past `step`
        # (or a torn one) instead of rewriting it.
        try:
            f = open(self.completions_path, "r+b")
        except FileNotFoundError:
            return
        with f:
            end = 0
            for line in f:
                try:
                    if not line.endswith(b"\n") or json.loads(line)["step"] > step:
                        break
                except (ValueError, KeyError, TypeError):
                    break
                end += len(line)
            f.truncate(end)

    # -- heartbeat.json -----------------------------------------------------------------------

    def heartbeat(self, step: int, phase: str, servers: Optional[Mapping[str, Any]] = None, **extra: Any) -> None:
        """Rewrite ``heartbeat.json``: time, step, phase, pid, host, ``servers`` (node -> health dict)."""
        if not self.active:
            return
        record = {"time": time.time(), "step": int(step), "phase": phase, "pid": os.getpid(), "host": self._host,
                  "servers": _plain(dict(servers or {}))}
        record.update(_plain(extra))
        atomic_write(self.heartbeat_path, json.dumps(record, indent=1) + "\n")

    # -- TensorBoard / W&B --------------------------------------------------------------------

    def _start_backends(self) -> None:
        self._backends_started = True
        if self._want_tb:
            if importlib.util.find_spec("tensorboard") is None:
                log.warning("logging.tensorboard: the tensorboard package is not installed; not logging to TensorBoard")
            else:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR), purge_step=self._purge_step)
        if self._want_wandb:
            if importlib.util.find_spec("wandb") is None:
                log.warning("logging.wandb: the wandb package is not installed; not logging to W&B")
            else:
                import wandb
                self._wandb = wandb.init(mode="offline", dir=str(self.run_dir), name=self._run_name,
                                         config=self._config)

    def _log_backends(self, record: Mapping[str, Any]) -> None:
        if not self._backends_started:
            self._start_backends()
        step = record[STEP]
        # Under the names transformers' TensorBoard and W&B callbacks give TRL's (train/reward,
        # eval/reward), so that a TRL user's dashboards read an hpcrl run unchanged.
        scalars = {dashboard_key(k): v for k, v in record.items()
                   if k not in (STEP, TIME) and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_completion(row: Mapping[str, Any], width: int = 60) -> str:
    """A logged completion as one console line: its step, advantage, rewards, prompt and text (shortened)."""
    prompt = row["prompt"]
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], Mapping):
        prompt = prompt[-1].get("content", "")         # a conversation: its last message
    completion = row["completion"]
    if isinstance(completion, list) and completion and isinstance(completion[-1], Mapping):
        completion = completion[-1].get("content", "")     # a multi-turn rollout: its last turn
    rewards = "  ".join(f"{name} {_number(value, '.3f')}" for name, value in row["rewards"].items())
    return (f"completion  step {row['step']}  advantage {_number(row['advantage'], '+.3f')}  {rewards}  "
            f"{_shorten(prompt, width)} -> {_shorten(completion, width)}")


def _number(value: Any, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, fmt)


def _shorten(text: Any, width: int) -> str:
    text = repr(str(text))         # quoted, newlines visible
    return text if len(text) <= width else text[:width - 4] + "...'"
