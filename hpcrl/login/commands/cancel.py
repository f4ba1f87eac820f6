"""`hpcrl cancel`: scancel a registered job. A SlurmError propagates to cli.main, which reports it."""

from __future__ import annotations

from hpcrl.login import slurm
from hpcrl.login.registry import Registry
from hpcrl.login.status import find_record


def main(args) -> int:
    record = find_record(Registry(), args.job_id)
    slurm.cancel(record.job_id)
    print(f"cancelled job {record.job_id} ({record.name})")
    return 0
