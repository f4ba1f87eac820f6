"""A launch's processes, found by its id (HPCRL_LAUNCH_ID in their environment): the stop request
to its tasks, and SIGKILL to all of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from hpcrl.job.process_group import kill_group


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
    kill_group(proc.pid)
    for pid, _ in launch_processes(launch_id) if launch_id else ():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
