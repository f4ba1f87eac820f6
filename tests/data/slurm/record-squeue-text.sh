#!/usr/bin/env bash
# Records squeue-22.05.txt: `squeue -O hpcrl.login.slurm.SQUEUE_FORMAT` on the testbed for the jobs
# tests/login/test_slurm.py reads (done, exit 3, held, cancelled, running, killed by SIGKILL, an -o
# pattern, a requeued job, a name holding '|').
#   SLURM_CONF=/tmp/hpcrl-testbed/etc/slurm.conf bash tests/data/slurm/record-squeue-text.sh
# Job ids and times are whatever the testbed hands out; the test looks jobs up by name.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
fmt=$("$repo/.venv/bin/python" -c 'from hpcrl.login.slurm import SQUEUE_FORMAT; print(SQUEUE_FORMAT)')
work=$(mktemp -d /tmp/slcap-XXXX)
cd "$work"
sub() { sbatch --parsable "$@" | cut -d';' -f1; }
ids=(
  "$(sub -J ok -t 5 --wrap true)"
  "$(sub -J fail3 --wrap 'exit 3')"
  "$(sub -J held --hold --wrap true)"
  "$(sub -J cancelme --wrap 'sleep 300')"
  "$(sub -J running -t 1-02:00:00 --wrap 'sleep 300')"
  "$(sub -J sig9 --wrap 'kill -9 $$')"
  "$(sub -J without -o out-%j.txt --wrap 'sleep 300')"
  "$(sub -J rq --requeue --wrap 'sleep 300')"
  "$(sub -J 'a|b' --hold -o "$work/a/out-%x-%j.log" --wrap true)"
)
sleep 3
scancel "${ids[3]}"
scontrol requeue "${ids[7]}"     # back to PENDING (BeginTime), RestartCnt 1
sleep 2
list=$(IFS=,; echo "${ids[*]}")
SLURM_TIME_FORMAT=%s squeue -h -t all -j "$list" -O "$fmt" > "$here/squeue-22.05.txt"
scancel "${ids[@]}"
cat "$here/squeue-22.05.txt"
