"""The run directory, and every name inside it: job.json (the spec) and job.sbatch (the script),
written whole or not at all by the login side; then what the job writes. Both sides take the names
from here (the sbatch template gets them from render.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from hpcrl.job.atomic import atomic_write
from hpcrl.job.errors import UserError

SPEC_FILE = "job.json"
SCRIPT_FILE = "job.sbatch"
# Slurm's output file; %j is the job id (the script's #SBATCH --output).
SLURM_OUTPUT = "slurm-%j.out"
# `hpcrl run`'s copy of everything its ranks print.
LOCAL_LOG_FILE = "run.log"
METRICS_FILE = "metrics.jsonl"
# logging.log_completions: every completion with its prompt, rewards and advantage, a line each.
COMPLETIONS_FILE = "completions.jsonl"
HEARTBEAT_FILE = "heartbeat.json"
PLOT_FILE = "metrics.png"
TENSORBOARD_DIR = "tensorboard"
# Training checkpoints, unless recipe checkpoint.dir says elsewhere.
CHECKPOINTS_DIR = "checkpoints"
# The trained model as a Hugging Face directory, written at the end of a run; grpo.save_steps and
# `hpcrl export` put theirs inside it as checkpoint-<step>/ (TRL's output_dir layout). Each is
# written under a hidden temporary name beside it and renamed when complete.
MODEL_DIR = "model"
MODEL_CHECKPOINT_PREFIX = "checkpoint-"
# hpcrl.compute.train.checkpoint's layout of a training checkpoint, for the login side (no torch):
# <checkpoints>/step-<N>/ is complete once it holds both files.
TRAINING_CHECKPOINT_PREFIX = "step-"
TRAINING_CHECKPOINT_META = "meta.json"        # written last, once every rank has written its part
# Each trainer engine's model and optimizer state in a checkpoint: DCP's index (fsdp2), DeepSpeed's
# own directory (deepspeed).
DCP_INDEX = ".metadata"
DEEPSPEED_STATE_DIR = "deepspeed"
TRAINING_CHECKPOINT_STATE = (DCP_INDEX, DEEPSPEED_STATE_DIR)
# One health file per engine (node-<n>-engine-<e>.json), read by the trainers into the heartbeat.
SERVERS_DIR = ".servers"
# Copies of the recipe's own reward, tool and environment modules (JobSpec.reward_modules): first on
# the trainers' sys.path.
REWARDS_DIR = "rewards"
# Per-launch meeting files, removed once every task has met; then who is who in the latest launch.
LAUNCH_DIR = ".launch"
RANKS_FILE = "ranks.json"
# recipe.mode probe/control: every task's row, one a line in rank order, written by rank 0 (a task's
# own line in the job's output can come out split: srun breaks lines over 1,024 bytes).
PROBE_FILE = "probe.jsonl"
# Written by trainer rank 0 when a run has done all its steps: the script then does not requeue.
FINISHED_MARKER = ".finished"
# Left by the script's signal trap: the trainers checkpoint, then the script requeues the job.
REQUEUE_MARKER = ".requeue-requested"
# Written by trainer rank 0 when it stopped at a signal with its checkpoint written and a step done
# since the attempt began: only then does the script requeue (a signal during start-up, or a failure
# after the signal, would otherwise requeue forever). Holds the step.
REQUEUE_READY_MARKER = ".requeue-ready"
# Left by `hpcrl cancel` before it sends the site's signal: the trainers checkpoint, and the script
# then cancels the job instead of requeueing it (a plain scancel's SIGTERM makes srun SIGKILL the step).
CANCEL_MARKER = ".cancel-requested"
# The first fatal line of the job's tasks (hpcrl.compute.launch.outcome), for `hpcrl status`.
FAILURE_FILE = "failure.txt"
# The final model against the base it was trained from (hpcrl.compute.train.base_diff): how many
# tensors changed, for the run's learning check.
MODEL_VS_BASE_FILE = "model-vs-base.json"
# Which run a checkpoint or output directory belongs to (run_identity): two runs sharing one would
# resume each other's weights or replace each other's model. Written into checkpoint.dir and
# checkpoint.output_dir when a run directory is created (create), and into the checkpoint directory
# by the trainers' first save; compose refuses a directory that another run's names.
RUN_IDENTITY_FILE = ".hpcrl-run.json"


def model_vs_base(run_dir: str | os.PathLike) -> dict | None:
    """MODEL_VS_BASE_FILE's counts, None when the run wrote none (or it cannot be read)."""
    try:
        data = json.loads((Path(run_dir) / MODEL_VS_BASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def server_health_file(run_dir: str | os.PathLike, node: int, engine: int) -> Path:
    return Path(run_dir) / SERVERS_DIR / f"node-{node}-engine-{engine}.json"


def engine_shm_record(run_dir: str | os.PathLike, node: int, engine: int) -> Path:
    """The shared-memory files an engine's processes made (/dev/shm names, its host), kept so that
    what a killed engine leaves can be removed (hpcrl.compute.launch.shm_sweep). Not node-*.json:
    readers of the health files glob that."""
    return Path(run_dir) / SERVERS_DIR / f"shm-node-{node}-engine-{engine}.json"


def server_key(node: int, engine: int) -> str:
    """How the heartbeat's `servers` names an engine: "<node>/<engine>"."""
    return f"{node}/{engine}"


def server_key_order(key: str) -> tuple[int, ...]:
    """Sorts server keys by node, then engine (0, 1, 10 ..., not 0, 1, 10 as text); others last."""
    parts = str(key).split("/")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else (1 << 62,)


def model_dir(run_dir: str | os.PathLike, step: int | None = None, output_dir: str = "") -> Path:
    """The final model (step None), or the one saved at ``step``; ``output_dir`` is the recipe's
    checkpoint.output_dir (TRL's output_dir), "" for <run_dir>/model."""
    final = Path(output_dir) if output_dir else Path(run_dir) / MODEL_DIR
    return final if step is None else final / f"{MODEL_CHECKPOINT_PREFIX}{step}"


def model_checkpoint_steps(final: str | os.PathLike) -> list[int]:
    """The steps of the complete checkpoint-<step> model directories inside ``final``, in order."""
    steps = []
    for p in Path(final).glob(f"{MODEL_CHECKPOINT_PREFIX}*"):
        step = p.name.removeprefix(MODEL_CHECKPOINT_PREFIX)
        if step.isdigit() and is_model_dir(p):
            steps.append(int(step))
    return sorted(steps)


def is_model_dir(path: str | os.PathLike) -> bool:
    """A complete model directory: it is renamed into place only once its config.json is written
    (a LoRA run's: a peft adapter directory, adapter_config.json)."""
    return (Path(path) / "config.json").is_file() or (Path(path) / "adapter_config.json").is_file()


def training_checkpoint(checkpoints_dir: str | os.PathLike, step: int) -> Path | None:
    """``step-<step>`` under ``checkpoints_dir`` if it is a complete training checkpoint, else None."""
    path = Path(checkpoints_dir) / f"{TRAINING_CHECKPOINT_PREFIX}{step}"
    return path if is_complete_training_checkpoint(path) else None


def is_complete_training_checkpoint(path: str | os.PathLike) -> bool:
    """Its meta file (the commit's last write) and the model's state (either engine's) are there."""
    path = Path(path)
    return (path / TRAINING_CHECKPOINT_META).is_file() and any((path / f).exists() for f in TRAINING_CHECKPOINT_STATE)


def training_checkpoint_steps(checkpoints_dir: str | os.PathLike) -> list[int]:
    """The steps of the complete training checkpoints under ``checkpoints_dir``, oldest first."""
    try:
        names = [p.name for p in Path(checkpoints_dir).iterdir()]
    except OSError:
        return []
    steps = []
    for name in names:
        tail = name.removeprefix(TRAINING_CHECKPOINT_PREFIX)
        if name != tail and tail.isdigit() and training_checkpoint(checkpoints_dir, int(tail)):
            steps.append(int(tail))
    return sorted(steps)


def run_identity(job: dict) -> dict:
    """A run's identity from its job.json mapping. The run id is the run directory job.json names:
    compose never gives an existing one to a new run, and the run keeps it for its whole life
    (`hpcrl submit --resume`, requeues and `hpcrl run --resume` start the same job.json again, even
    from a run directory moved elsewhere). The recipe's digest tells a run rendered again at the
    path of a deleted one from the run that was there."""
    recipe = json.dumps(job.get("recipe"), sort_keys=True, separators=(",", ":"))
    return {"run_dir": str(job.get("run_dir") or ""), "recipe_sha256": hashlib.sha256(recipe.encode()).hexdigest()}


def job_identity(run_dir: str | os.PathLike) -> dict | None:
    """The identity of the run whose job.json is in ``run_dir``; None where there is none."""
    try:
        job = json.loads((Path(run_dir) / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None
    return run_identity(job) if isinstance(job, dict) else None


def read_identity(directory: str | os.PathLike) -> dict | None:
    """The identity written into a checkpoint or output directory; None where there is none."""
    try:
        identity = json.loads((Path(directory) / RUN_IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return identity if isinstance(identity, dict) and identity.get("run_dir") else None


def write_identity(directory: str | os.PathLike, identity: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / RUN_IDENTITY_FILE, json.dumps(identity, sort_keys=True) + "\n")


def owner(directory: str | os.PathLike, own_name: str) -> str | None:
    """The run directory of the run ``directory`` belongs to: the one its identity names, else the
    run whose own ``own_name`` (CHECKPOINTS_DIR, MODEL_DIR) it is, as runs from before identities
    left theirs; None when neither says."""
    identity = read_identity(directory)
    if identity is not None:
        return identity["run_dir"]
    directory = Path(directory)
    return str(directory.parent) if directory.name == own_name and (directory.parent / SPEC_FILE).is_file() else None


def is_run_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / SPEC_FILE).is_file()


def resume_command(run_dir: str | os.PathLike) -> str:
    """How a run continues: Slurm's have a script, `hpcrl run`'s have none."""
    how = "submit" if (Path(run_dir) / SCRIPT_FILE).is_file() else "run"
    return f"hpcrl {how} --resume {run_dir}"


def slurm_output(run_dir: str | os.PathLike, job_id: str) -> Path:
    return Path(run_dir) / SLURM_OUTPUT.replace("%j", str(job_id))


def create(run_dir: str | os.PathLike, spec_json: str, script: str | None,
           reward_modules: tuple[str, ...] = ()) -> Path:
    """Write the run directory atomically: a hidden sibling is filled, then renamed into place.
    ``reward_modules`` (JobSpec's: files, or package directories) are copied into REWARDS_DIR.
    The recipe's checkpoint.dir and checkpoint.output_dir, outside it, are claimed for the run
    (RUN_IDENTITY_FILE) first: a second run rendered before this one writes anything is refused."""
    run_dir = Path(run_dir)
    _claim(json.loads(spec_json))
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.", dir=run_dir.parent))
    except OSError as e:
        raise UserError(f"--run-dir: cannot create {run_dir}: {e.strerror}") from None
    try:
        (tmp / SPEC_FILE).write_text(spec_json + "\n")
        if script is not None:
            (tmp / SCRIPT_FILE).write_text(script)
            (tmp / SCRIPT_FILE).chmod(0o755)
        _copy_reward_modules(reward_modules, tmp / REWARDS_DIR)
        os.rename(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run_dir


def _claim(job: dict) -> None:
    checkpoint = (job.get("recipe") or {}).get("checkpoint") or {}
    for key in ("dir", "output_dir"):
        if checkpoint.get(key):
            try:
                write_identity(Path(checkpoint[key]).expanduser(), run_identity(job))
            except OSError as e:
                raise UserError(f"checkpoint.{key}: cannot write {RUN_IDENTITY_FILE} into {checkpoint[key]}: "
                                f"{e.strerror or e}") from None


def _copy_reward_modules(sources: tuple[str, ...], into: Path) -> None:
    for source in sources:
        src = Path(source)
        try:
            into.mkdir(exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, into / src.name, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, into / src.name)
        except OSError as e:
            raise UserError(f"rewards: cannot copy {src} into the run directory: {e.strerror or e}") from None


def check_output_path(path: str) -> Path:
    """`-o FILE` is checked before anything is written, so a bad path leaves nothing behind."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"--output: {path} is a directory")
    if not p.parent.is_dir():
        raise UserError(f"--output: directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK):
        raise UserError(f"--output: directory {p.parent} is not writable")
    return p


def read_failure(run_dir: str | os.PathLike) -> str | None:
    """Why the job's last attempt failed (hpcrl.compute.launch.outcome wrote it), as one line without its
    time stamp: "rank 7 (node 1, server) was killed by SIGKILL ..."; None if nothing failed."""
    try:
        text = (Path(run_dir) / FAILURE_FILE).read_text(errors="replace").strip()
    except OSError:
        return None
    if not text:
        return None
    line = text.splitlines()[0].split(" ", 1)[-1]
    return line.removeprefix("hpcrl: ").removesuffix("; exiting")


def read_metrics(run_dir: str | os.PathLike, max_bytes: int | None = None) -> list[dict]:
    """Every complete line of ``metrics.jsonl`` (a torn last line is skipped); with ``max_bytes``,
    those of the file's last ``max_bytes`` only (a long run's file is large)."""
    try:
        with open(Path(run_dir) / METRICS_FILE, "rb") as f:
            start = 0
            if max_bytes is not None:
                start = max(0, f.seek(0, os.SEEK_END) - max_bytes)
                f.seek(start)
            lines = f.read().splitlines()[1 if start else 0:]      # a tail's first line may be cut
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def other_steps_hint(run_dir: str, step: int, steps: list[int], output: str | None) -> str:
    """What to export instead of a damaged checkpoint: the newest older step, as a command (`hpcrl
    export` says it before it starts the export, the export itself when it finds the damage)."""
    import shlex

    others = [s for s in steps if s != step]
    if not others:
        return "the run has no other checkpoint to export instead"
    pick = ([s for s in others if s < step] or others)[-1]
    cmd = ["hpcrl", "export", str(run_dir), "--step", str(pick), *(["-o", output] if output else [])]
    return f"export another step: {shlex.join(cmd)} (other checkpoints: {', '.join(map(str, others))})"
