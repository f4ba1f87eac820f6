"""`hpcrl run`: a recipe on this machine, without Slurm (the mpiexec supervisor is hpcrl.login.local)."""

from __future__ import annotations

from hpcrl.login import local


def main(args) -> int:
    return local.run(args)
