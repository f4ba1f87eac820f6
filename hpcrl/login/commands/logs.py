"""`hpcrl logs`: print a job's Slurm output file, or follow it until the job ends."""

from __future__ import annotations

import sys
import time

from hpcrl.login.registry import Registry
from hpcrl.login.status import find_record, finished, log_path, refresh


def main(args) -> int:
    registry = Registry()
    record = find_record(registry, args.job_id)
    states, _ = refresh(registry, [record])
    log = log_path(record, states[record.job_id])
    if log is None:
        print(f"hpcrl: job {record.job_id} has no log yet", file=sys.stderr)
        return 1
    with log.open("rb") as f:
        sys.stdout.buffer.write(f.read())
        sys.stdout.flush()
        while args.follow:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            states, _ = refresh(registry, [record])
            if finished(states[record.job_id]):
                sys.stdout.buffer.write(f.read())
                return 0
            time.sleep(1.0)
    return 0
