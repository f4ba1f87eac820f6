"""A training run's progress on the console: a bar over its optimizer steps while it runs, fed by
<run_dir>/metrics.jsonl (only when stdout and stderr are both terminals), and a summary when it
ends: steps done, wall time, reward at the start and at the end, where the metrics, the plot and
the trained model are."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from pathlib import Path

from hpcrl.job import metric_keys as mk
from hpcrl.job import rundir
from hpcrl.job.rundir import LOCAL_LOG_FILE, METRICS_FILE
from hpcrl.job.slurm_time import format_walltime
from hpcrl.login.local.exit_codes import INTERRUPTED


class Progress:
    """A tqdm bar over optimizer steps, fed by tailing <run_dir>/metrics.jsonl (:meth:`poll`).

    Shown only when stdout and stderr are both terminals (else it would splice into piped or
    logged output): then a stream's lines are written inside :meth:`writing`, which lifts the
    bar off the screen and puts it back under them. Without tqdm there is no bar, nothing else changes.
    """

    def __init__(self, run_dir: Path, total: int, file=None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        # max_steps -1 (epochs): the trainer counts the steps and its metrics say how many.
        self.total = total if total > 0 else None
        self.bar = None
        self._offset = 0
        self._partial = b""
        self._size = -1
        self._seen_step = False
        file = file or sys.stderr
        try:
            from tqdm import tqdm
        except ImportError:
            return
        shown = _isatty(sys.stdout) and _isatty(file)
        if shown:
            self.bar = tqdm(total=total, file=file, unit="step", desc="training", dynamic_ncols=True,
                            mininterval=0.5, smoothing=0.1,
                            bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")
            self.bar.set_postfix_str("starting: model and inference engine", refresh=True)

    def writing(self):
        """Context for writing a line of the job's output."""
        bar = self.bar
        return bar.external_write_mode(file=bar.fp) if bar is not None else contextlib.nullcontext()

    def poll(self) -> None:
        """Read the lines metrics.jsonl got since the last call; move the bar to the last step."""
        if self.bar is None:
            return
        try:
            self._poll()
        except Exception:                        # a progress bar must never end a run: drop it
            bar, self.bar = self.bar, None
            with contextlib.suppress(Exception):
                bar.close()

    def _poll(self) -> None:
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size == self._size:
            return
        if size < self._offset:                  # rewritten (a resume drops the steps past its checkpoint)
            self._offset, self._partial = 0, b""
        self._size = size
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        last = None
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get(mk.STEP), int):
                last = rec
        if last is None:
            return
        if isinstance(last.get(mk.MAX_STEPS), int) and last[mk.MAX_STEPS] != self.total:
            self.total = self.bar.total = last[mk.MAX_STEPS]
        step = min(last[mk.STEP], self.total or last[mk.STEP])
        step_s = last.get(mk.TIME_STEP_S)
        if not self._seen_step and isinstance(step_s, (int, float)) and step > self.bar.n:
            # The ETA from the steps' own time, not from the engine's start-up before the first one.
            self.bar.last_print_t = max(self.bar.start_t, self.bar._time() - step_s * (step - self.bar.n))
        self._seen_step = True
        bits = []
        if isinstance(last.get(mk.REWARD), (int, float)):
            bits.append(f"reward {last[mk.REWARD]:.3f}")
        if isinstance(step_s, (int, float)):
            bits.append(f"step {step_s:.1f}s")
        self.bar.set_postfix_str("  ".join(bits), refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        else:
            self.bar.n = step
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.poll()
            self.bar.close()
            self.bar = None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _mean_over(steps: list[dict]) -> tuple[float | None, str]:
    vals = [r[mk.REWARD] for r in steps if isinstance(r.get(mk.REWARD), (int, float))]
    first, last = steps[0][mk.STEP], steps[-1][mk.STEP]
    where = f"step {first}" if first == last else f"mean of steps {first}-{last}"
    return (sum(vals) / len(vals) if vals else None), where


def print_summary(run_dir: Path, max_steps: int, wall_s: float, code: int, file=None, output_dir: str = "") -> None:
    """What the run did, after mpiexec is gone; the plot too when it ended well."""
    from hpcrl.login import plot

    file = file or sys.stdout
    steps = plot.load_steps(run_dir)
    if not steps and code != 0:
        return                                   # it failed before a step: its error says it all
    done = steps[-1][mk.STEP] if steps else 0
    if steps and isinstance(steps[-1].get(mk.MAX_STEPS), int):
        max_steps = steps[-1][mk.MAX_STEPS]        # the trainer's count when the recipe gave epochs
    ending = "" if code == 0 else (" (interrupted)" if code == INTERRUPTED else f" (exit code {code})")
    of = f" of {max_steps}" if max_steps > 0 else ""
    lines = [f"hpcrl: {'finished' if code == 0 and done >= max_steps else 'stopped'}: step {done}{of} "
             f"in {format_walltime(wall_s)}{ending}"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"          # noqa: E731
    trained = [s for s in steps if s[mk.STEP] >= 1]     # step 0: an evaluation before training (eval_on_start)
    if trained:
        k = max(1, min(10, len(trained) // 5))
        start, start_where = _mean_over(trained[:k])
        end, end_where = _mean_over(trained[-k:])
        lines.append(f"  reward    {fmt(start)} at the start ({start_where}) -> "
                     f"{fmt(end)} at the end ({end_where})")
    eval_reward = mk.eval_key(mk.REWARD)
    evaluated = [s for s in steps if isinstance(s.get(eval_reward), (int, float))]
    if evaluated:
        first, last = evaluated[0], evaluated[-1]
        lines.append(f"  eval      reward {fmt(first[eval_reward])} at step {first[mk.STEP]} -> "
                     f"{fmt(last[eval_reward])} at step {last[mk.STEP]} ({last.get(mk.EVAL_COMPLETIONS, '?')} "
                     f"completions of the eval split)")
    lines.append(f"  metrics   {run_dir / METRICS_FILE}")
    if code == 0 and steps:
        try:
            lines.append(f"  plot      {plot.write_plot(run_dir)}")
        except ImportError:
            lines.append("  plot      not written: matplotlib is not installed (pip install matplotlib)")
        except Exception as e:                   # a plot must never turn a good run into a failure
            lines.append(f"  plot      not written: {type(e).__name__}: {e}")
    elif steps:
        lines.append(f"  plot      hpcrl plot {shlex.quote(str(run_dir))}")
    lines.append(f"  log       {run_dir / LOCAL_LOG_FILE}")
    model = rundir.model_dir(run_dir, output_dir=output_dir)
    if rundir.is_model_dir(model):
        lines.append(f"  model     {model}")
    elif rundir.training_checkpoint_steps(run_dir / rundir.CHECKPOINTS_DIR):
        # A run stopped early has no final model; its last checkpoint can still be turned into one,
        # or trained on.
        lines.append(f"  model     not written (stopped early); hpcrl export {shlex.quote(str(run_dir))}")
        lines.append(f"  resume    hpcrl run --resume {shlex.quote(str(run_dir))}")
    # Last, so that a run which ran to its end but taught the policy nothing does not end on "finished".
    nothing = mk.learning_check(trained, plot.num_generations(run_dir), rundir.model_vs_base(run_dir))
    if nothing:
        lines.append(f"hpcrl: {nothing}")
    print("\n".join(lines), file=file, flush=True)
