"""`hpcrl run`: the same compute-side entry as a Slurm job, started by mpiexec on this machine.

The PyPI `mpich` runtime gives machines without a system MPI an `mpiexec` next to the
interpreter, which is looked at first; then PATH. Output is streamed and kept in
<run_dir>/run.log; the exit status is mpiexec's.

When a rank fails, mpiexec (hydra) kills the others at once; the failing rank has named itself
by then (hpcrl.compute.launch.supervisor), which hydra's banner would not. Every rank also bounds its
waits for what no launcher sees, a rank that never arrives or hangs: the supervisor bounds the
rendezvous, hpcrl.compute.launch.watchdog every wait after it.
As a last resort, ranks still running some time after one of them announced a fatal exit are
stopped, and so are all of them on Ctrl-C.

A training run shows a progress bar over optimizer steps (fed by <run_dir>/metrics.jsonl; only
when stdout and stderr are both terminals) under the job's own lines, and ends with a summary:
steps done, wall time, reward at the start and at the end, where the metrics, the plot and the
trained model are.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from hpcrl.job.errors import UserError
from hpcrl.job import metric_keys as mk
from hpcrl.job import rundir
from hpcrl.job.rundir import LOCAL_LOG_FILE, METRICS_FILE
from hpcrl.job.slurm_time import format_walltime

INTERRUPTED = 130            # supervise's code for a run stopped by Ctrl-C or SIGTERM (128 + SIGINT)
# After the first Ctrl-C / SIGTERM the trainers checkpoint at the end of their step: this long at
# most, or until a second one; then the ranks get STOP_GRACE_S before SIGKILL.
CHECKPOINT_GRACE_S = 120.0
STOP_GRACE_S = 10.0
AFTER_FAILURE_GRACE_S = 15.0  # beyond peer_failure_timeout_s, after a rank announced a fatal exit
# Every fatal message of hpcrl.compute.launch ends so (watchdog.die, the supervisor, main).
_FATAL_LINE = re.compile(r"^hpcrl: .*; exiting\s*$")


def find_mpiexec() -> str:
    # sys.executable unresolved: in a venv it is <venv>/bin/python, beside the mpich wheel's mpiexec.
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found:
        return found
    raise UserError(f"no mpiexec next to {sys.executable} or on PATH: `hpcrl run` needs an MPI runtime "
                    f"(pip install mpich, or load your site's MPI module)")


def mpi_flavor(mpiexec: str) -> str:
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in text:
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    return "unknown"


def launch_command(mpiexec: str, flavor: str, python: str, world_size: int, run_dir: str) -> list[str]:
    flags: list[str] = []
    if flavor == "openmpi":
        # hpcrl pins each rank itself; Open MPI's own core binding would leave it no cores to pin.
        flags = ["--bind-to", "none", "--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return [mpiexec, "-n", str(world_size), *flags, python, "-u", "-m", "hpcrl.compute.launch", run_dir]


def run(args) -> int:
    from hpcrl.job import rundir
    from hpcrl.login import compose

    spec = _resumed(args) if args.resume else compose.from_args(args)
    site = spec.site
    if site.launcher != "mpiexec":
        raise UserError(f"--site: {site.name} starts its tasks with srun; `hpcrl run` runs on this machine "
                        f"without Slurm (use `hpcrl submit --site {site.name}`)")
    plan = spec.plan()
    mpiexec = find_mpiexec()
    cmd = launch_command(mpiexec, mpi_flavor(mpiexec), spec.python, plan.world_size, spec.run_dir)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    # The site's variables, as the sbatch script exports them; no shell runs between here and the
    # ranks, so $HOME and the like in them are expanded here.
    env.update({k: os.path.expandvars(v) for k, v in spec.environment().items()})
    env.update(HPCRL_RUN_DIR=spec.run_dir, HPCRL_LAUNCH_ID=f"local-{uuid.uuid4().hex[:12]}", PYTHONUNBUFFERED="1")
    if args.resume:
        run_dir = Path(spec.run_dir)
        (run_dir / rundir.FAILURE_FILE).unlink(missing_ok=True)     # the last attempt's, not this one's
        steps = rundir.training_checkpoint_steps(Path(spec.recipe.checkpoint.dir or run_dir / rundir.CHECKPOINTS_DIR))
        print(f"hpcrl: resuming {run_dir} " + (f"from its checkpoint of step {steps[-1]}" if steps
                                                else "from the start: it has no checkpoint"),
              file=sys.stderr, flush=True)
    else:
        run_dir = rundir.create(spec.run_dir, spec.to_json(), None, spec.reward_modules)
        print(f"hpcrl: run directory {run_dir}; {plan.world_size} tasks ({plan.num_trainers} trainer(s), "
              f"{plan.nodes * plan.engines_per_node} engine(s))", file=sys.stderr, flush=True)
    grace = spec.recipe.launch.peer_failure_timeout_s + AFTER_FAILURE_GRACE_S
    console = ConsoleFilter()
    if spec.recipe.mode != "train":
        code = supervise(cmd, env, run_dir / LOCAL_LOG_FILE, grace, console=console)
        print_failure(run_dir, code, console)
        return code
    progress = Progress(run_dir, spec.recipe.grpo.max_steps)
    t0 = time.monotonic()
    try:
        code = supervise(cmd, env, run_dir / LOCAL_LOG_FILE, grace, progress, console=console)
    finally:
        progress.close()
    print_summary(run_dir, spec.recipe.grpo.max_steps, time.monotonic() - t0, code,
                  output_dir=spec.recipe.checkpoint.output_dir)
    print_failure(run_dir, code, console)
    return code


def _resumed(args):
    """`hpcrl run --resume RUN_DIR`: the run's own spec, continued from its latest checkpoint."""
    from hpcrl.job.spec import JobSpec
    from hpcrl.login.api import job_args_given

    given = [g for g in job_args_given(args) if not (g == "--site" and args.site == "local")]   # run's default
    if given:
        raise UserError(f"--resume: takes no {', '.join(given)}; the run keeps the spec it started with")
    path = Path(args.resume).expanduser().absolute()
    spec = JobSpec.load(path)                      # UserError when it is not a run directory
    if spec.site.launcher != "mpiexec":
        raise UserError(f"--resume: {path} is a Slurm job's run directory (site {spec.site.name}); "
                        f"resume it with `hpcrl submit --resume {shlex.quote(str(path))}`")
    if (path / rundir.FINISHED_MARKER).exists():
        raise UserError(f"--resume: {path} already finished its training")
    return spec


class ConsoleFilter:
    """Which of the job's lines reach the console: all but tracebacks (Python's, and those vLLM's
    engine processes log, each line under a prefix like "(EngineCore pid=12) ERROR 11-27 09:12:08
    [core.py:1510] ") and MPICH's "BAD TERMINATION" banner, which run.log keeps. A failed run's
    cause is printed last instead, in the one line the job wrote to failure.txt
    (:func:`print_failure`). One per run; its state is per stream and per prefix (the ranks'
    tracebacks come on stderr, hydra's banner and vLLM's log on stdout, and one process's lines
    may come between another's)."""

    BANNER = re.compile(r"^(={20,}\s*$|=   |YOUR APPLICATION TERMINATED WITH THE EXIT STRING|"
                        r"This typically refers to a problem with your application|"
                        r"Please see the FAQ page for debugging suggestions)")
    CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
    # vLLM's process tag and log header; every line of a multi-line record repeats both.
    PREFIX = re.compile(r"^(\([\w.\-]+ pid=\d+\) )?((DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                        r"\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \[[^\]]*\] )?")
    # multiprocessing's line before a child process's traceback
    PROCESS_HEADER = re.compile(r"^Process [\w.\-]+:\s*$")

    def __init__(self) -> None:
        self.tracebacks = 0
        self._state: dict[tuple[str, str], str] = {}     # (stream, prefix) -> "", "traceback", "after" or "banner"

    def show(self, line: str, stream: str = "stderr") -> bool:
        text = line.rstrip("\r\n")
        prefix = self.PREFIX.match(text).group(0)
        body, key = text[len(prefix):], (stream, prefix)
        state = self._state.get(key, "")
        if not prefix and self.BANNER.match(text):
            self._state[key] = "banner"
            return False
        if body.startswith("Traceback (most recent call last):"):
            if state not in ("traceback", "after"):
                self.tracebacks += 1
            self._state[key] = "traceback"
            return False
        if not prefix and self.PROCESS_HEADER.match(text):
            return False
        if state == "traceback":
            if not body.strip() or body[:1].isspace():
                return False
            if not prefix and text.startswith(("hpcrl: ", "[hpcrl ")):     # another rank's line, mid-traceback
                return True
            self._state[key] = "after"                          # the exception's own line ends it
            return False
        # after it: the rest of a multi-line message (indented, as pydantic's), the chaining lines
        if state == "after" and (not body.strip() or body[:1].isspace() or body.startswith(self.CHAINED)):
            return False
        if state == "banner" and (not body.strip() or body.startswith(self.CHAINED)):
            return False
        self._state[key] = ""
        return True


def print_failure(run_dir: Path, code: int, console: ConsoleFilter, file=None) -> None:
    """After everything else: where the whole output is, then why the run failed, in one line."""
    file = file or sys.stderr
    log = run_dir / LOCAL_LOG_FILE
    if code == INTERRUPTED:
        # The user's Ctrl-C (or a SIGTERM): the ranks' KeyboardInterrupt is its echo, not an error.
        print(f"hpcrl: interrupted; the job's whole output is in {log}", file=file, flush=True)
        return
    reason = rundir.read_failure(run_dir) if code != 0 else None
    if reason:
        print(f"hpcrl: the job's whole output, tracebacks included, is in {log}", file=file)
        print(f"hpcrl: error: {reason}", file=file, flush=True)
    elif console.tracebacks:
        print(f"hpcrl: {console.tracebacks} traceback(s) from the job are in {log} only", file=file, flush=True)


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


def supervise(cmd: list[str], env: dict, log_path: Path, after_failure_s: float,
              progress: Progress | None = None, console: ConsoleFilter | None = None,
              checkpoint_grace_s: float = CHECKPOINT_GRACE_S) -> int:
    """Run `cmd` in its own session, tee its output (every line to `log_path`, those `console`
    lets through to this process's stdout/stderr), and bound every way of ending it. The first
    Ctrl-C or SIGTERM asks the trainers to checkpoint and stop; a second, or `checkpoint_grace_s`,
    stops every rank at once."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    launch_id = env.get("HPCRL_LAUNCH_ID")
    failed_at: list[float] = []
    stop_requested = False         # the first Ctrl-C's stop request went to the ranks
    lock = threading.Lock()
    with open(log_path, "ab") as log:
        def pump(src, dst) -> None:
            stream = "stdout" if dst is sys.stdout else "stderr"
            for line in iter(src.readline, b""):
                with lock, (progress.writing() if progress is not None else contextlib.nullcontext()):
                    if console is None or console.show(line.decode(errors="replace"), stream):
                        dst.buffer.write(line)
                        dst.flush()
                    log.write(line)
                    log.flush()
                if not failed_at and _FATAL_LINE.match(line.decode(errors="replace")):
                    failed_at.append(time.monotonic())

        pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)]
        for t in pumps:
            t.start()
        stops: list[float] = []      # when each Ctrl-C / SIGTERM came
        wake = threading.Event()

        def on_stop(*_):
            stops.append(time.monotonic())
            wake.set()

        old = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)
               if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            while proc.poll() is None:
                if progress is not None:
                    progress.poll()
                if stops and (len(stops) > 1 or time.monotonic() - stops[0] > checkpoint_grace_s):
                    if progress is not None:
                        progress.close()
                    print("hpcrl: interrupted; stopping the ranks now", file=sys.stderr, flush=True)
                    _stop(proc, launch_id)
                    return INTERRUPTED
                if stops and not stop_requested:
                    stop_requested = True
                    with lock, (progress.writing() if progress is not None else contextlib.nullcontext()):
                        print(f"hpcrl: interrupted; the trainers checkpoint at the end of their step "
                              f"(Ctrl-C again to stop now)", file=sys.stderr, flush=True)
                    request_stop(launch_id)
                if failed_at and time.monotonic() - failed_at[0] > after_failure_s:
                    if progress is not None:
                        progress.close()
                    print(f"hpcrl: ranks still running {after_failure_s:.0f} s after a fatal error; stopping them",
                          file=sys.stderr, flush=True)
                    _stop(proc, launch_id)
                    break
                wake.wait(0.2)
                wake.clear()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            kill_launch(proc, launch_id)    # leftovers (engine processes) of a finished launch
            for t in pumps:
                t.join(2.0)
            if env.get("HPCRL_RUN_DIR"):
                _sweep_shared_memory(env["HPCRL_RUN_DIR"], env)
    code = proc.wait()
    if stops:
        return INTERRUPTED
    return code if code >= 0 else 128 - code


def _sweep_shared_memory(run_dir: str, env: dict) -> None:
    """What killed engines left in /dev/shm (hpcrl.compute.launch.shm_sweep; compute-side code, so
    run, not imported). Bounded, and never the run's failure."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-m", "hpcrl.compute.launch.shm_sweep", run_dir], env=env, timeout=30,
                       stdout=subprocess.DEVNULL)


def launch_processes(launch_id: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process of this user that carries the launch's id in its
    environment: the ranks and all they started, vLLM's engine processes included. Not by process
    tree or session: hydra puts each rank in a session of its own, and a dead rank's children are
    reparented to init."""
    marker = f"HPCRL_LAUNCH_ID={launch_id}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:                 # gone meanwhile, or another user's
            continue
        found.append((int(proc.name), cmdline))
    return found


def request_stop(launch_id: str) -> None:
    """The stop request (SIGUSR2, as Slurm's warning) to every hpcrl task of the launch: hydra does
    not forward it. The engines' processes are not tasks, and ignore it anyway."""
    for pid, cmdline in launch_processes(launch_id):
        if "hpcrl.compute.launch" in cmdline and "mpiexec" not in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR2)


def kill_launch(proc: subprocess.Popen, launch_id: str | None) -> None:
    """SIGKILL mpiexec's process group and every process of the launch; one already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid, _ in launch_processes(launch_id) if launch_id else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _stop(proc: subprocess.Popen, launch_id: str | None) -> None:
    """SIGINT to mpiexec (it forwards it), then SIGKILL to the whole session after a bound."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    kill_launch(proc, launch_id)
    proc.wait()
