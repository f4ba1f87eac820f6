"""Which mpiexec starts `hpcrl run`'s ranks, and its command line.

The PyPI `mpich` runtime gives machines without a system MPI an `mpiexec` next to the
interpreter, which is looked at first; then PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hpcrl.job.errors import UserError


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
