"""`hpcrl cancel`: stop a registered job, its trainers' checkpoint first.

A plain scancel's SIGTERM makes srun SIGKILL the step: everything since the last checkpoint.every
checkpoint would be lost. So a running job gets the site's signal instead (the one Slurm sends
before the time limit), with a marker that tells the batch script to cancel the job once the
trainers have checkpointed, instead of requeueing it. `--now`, a pending job, or a site without a
signal: scancel at once. A SlurmError propagates to cli.main, which reports it.
"""

from __future__ import annotations

import json

from hpcrl.job import rundir
from hpcrl.login import slurm
from hpcrl.login.registry import Registry
from hpcrl.login.status import find_record


def main(args) -> int:
    record = find_record(Registry(), args.job_id)
    if not args.now and _checkpoint_first(record):
        print(f"job {record.job_id} ({record.name}): the trainers checkpoint at the end of their step, then the "
              f"job is cancelled (`hpcrl cancel --now {record.job_id}` stops it at once)")
        return 0
    slurm.cancel(record.job_id)
    print(f"cancelled job {record.job_id} ({record.name})")
    return 0


def _checkpoint_first(record) -> bool:
    """Ask a running job to checkpoint and stop; False where it cannot be asked (then scancel)."""
    try:
        site_signal = json.loads((record.run_dir / rundir.SPEC_FILE).read_text())["site"]["signal"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not site_signal:
        return False
    marker = record.run_dir / rundir.CANCEL_MARKER
    try:
        marker.touch()
        slurm.signal_batch(record.job_id, site_signal.partition("@")[0])
    except (OSError, slurm.SlurmError):           # not running (pending, ended), or no run directory
        marker.unlink(missing_ok=True)
        return False
    return True
