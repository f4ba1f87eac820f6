#!/usr/bin/env bash
# The test command: install what the tests need, start the Slurm testbed, run pytest, stop the
# testbed (only if this script started it). Arguments go to pytest: scripts/test.sh -k render
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export SLURM_BASE=${SLURM_BASE:-/tmp/hpcrl-testbed}
started=""
if ! SLURM_CONF=$SLURM_BASE/etc/slurm.conf scontrol ping 2>/dev/null | grep -q UP; then
  # 24 nodes x 8 fake GPUs: tests/compute/launch/test_launch_scale.py launches a Frontier-shaped job
  # (16 x 8 tasks) through srun, while the side lane's jobs (below) may hold up to
  # 6 nodes; the other jobs take 1 or 2.
  SLURM_NODES=${SLURM_NODES:-24} SLURM_NODE_GPUS=${SLURM_NODE_GPUS:-8} bash scripts/slurm-testbed.sh start
  started=1
fi
side=""
cleanup() {
  [ -n "$side" ] && kill -- "-$side" 2>/dev/null || true
  rm -rf "${side_log:-}" "${side_tmp:-}" "${model_cache:-}"
  [ -n "$started" ] && [ -z "${HPCRL_KEEP_TESTBED:-}" ] && bash scripts/slurm-testbed.sh stop || true
  # The CI budget (issue #29): install, testbed and tests together, against 30 minutes.
  echo "hpcrl: CI time ${SECONDS} s of a 1800 s budget ($((SECONDS * 100 / 1800))%)"
}
trap cleanup EXIT
# Ctrl-C reaches the main lane only (the side lane has a process group of its own): exit, and cleanup
# ends the side lane, instead of waiting for it.
trap 'exit 130' INT TERM
export SLURM_CONF=$SLURM_BASE/etc/slurm.conf

# The whole suite runs in two lanes side by side (issue #29: CI time; HPCRL_TEST_LANES=0: one lane).
# On its own the suite leaves a third of CI's 2 cores idle: its runs hand work between a trainer and
# an engine, its Slurm jobs sleep through their faults, its launches wait out their bounds, and its
# first minutes run in pytest's own process. The side lane is the whole runs, Slurm jobs and launches
# (SIDE_LANE: a tenth of the tests, over 40 % of their CPU time), then the GPU tier's CPU self-check;
# the main lane, everything else. Both share the testbed (24 nodes, so that the 16-node job always
# finds its nodes) and one cache of demo models (tests/conftest.py: the main lane warms them up).
# Each lane prints its own failures and slowest tests; the script fails if either does.
# The load found real races (a killed vLLM engine core reported by the trainer's "EngineDeadError
# ... see stack trace" instead of the engine's own reason, fixed in the server; a failing task's
# reason lost when mpiexec killed rank 0 first, fixed in the watchdog): tests that pass only on an
# idle machine are bugs of the product or the test, not of the lanes.
LANES=${HPCRL_TEST_LANES:-1}
# The last three (a 160-step LoRA learning run, ~90 s alone; DeepSpeed's syncs, ~27 s alone; the sync
# gathers, ~35 s alone) balance the lanes: without them the main lane ended minutes after the side
# lane's tests (rehearsals of 2026-12-02: 1,945 s against 1,555 s; with test_lora.py moved, 1,722 s
# against 1,490 + 98 s of the GPU tier; with test_deepspeed_sync.py too, 1,664 s against 1,439 + 104 s).
SIDE_LANE=(tests/e2e tests/compute/launch tests/compute/train/test_lora.py tests/compute/sync/test_deepspeed_sync.py
           tests/compute/sync/test_sync_gather.py)
side_lane() {
  local status=0
  if [ "$LANES" = 1 ]; then
    HPCRL_TEST_WARM_UP=0 .venv/bin/python -m pytest -ra --durations=15 -p no:cacheprovider \
      --basetemp "$side_tmp/side" "${SIDE_LANE[@]}" || status=$?
  fi
  # The GPU tier (tests/compute/train/test_gpu*.py, tests/compute/sync/test_ipc_gpu.py) skips in the suite
  # without a GPU. Its own logic runs on the CPU (HPCRL_GPU_TIER_DEVICE=cpu: gloo, no CUDA kernel or
  # NCCL), so that the tier a session lent a GPU runs has not rotted meanwhile (~2 minutes).
  echo "GPU tier on the CPU (HPCRL_GPU_TIER_DEVICE=cpu):"
  HPCRL_TEST_WARM_UP=0 HPCRL_GPU_TIER_DEVICE=cpu nice -n 5 .venv/bin/python -m pytest -q -p no:cacheprovider \
    --basetemp "$side_tmp/gpu" -m gpu tests/compute/train/test_gpu.py tests/compute/train/test_gpu_memory.py \
    tests/compute/train/test_gpu_moe.py tests/compute/sync/test_ipc_gpu.py || status=$?
  return "$status"
}
main_only=()
if [ $# -eq 0 ]; then
  model_cache=$(mktemp -d /tmp/hpcrl-model-cache-XXXXXX)
  export HPCRL_TEST_MODEL_CACHE=$model_cache
  side_log=$(mktemp /tmp/hpcrl-side-lane-XXXXXX.log)
  side_tmp=$(mktemp -d /tmp/hpcrl-side-lane-XXXXXX)
  set -m        # the lane in a process group of its own, which cleanup can end as a whole
  side_lane > "$side_log" 2>&1 &
  side=$!
  set +m
  [ "$LANES" = 1 ] && main_only=("${SIDE_LANE[@]/#/--ignore=}")
  # The main lane warms the demo models up in the background while its in-process tests run first.
  export HPCRL_TEST_WARM_UP=${HPCRL_TEST_WARM_UP:-1}
fi
# The slowest tests are listed last, so that CI time can be kept in view (aim: under 30 minutes).
# HPCRL_TEST_WORKERS=N runs the main lane in N pytest-xdist workers (a test file stays on one worker,
# the whole-run folders start first: tests/conftest.py). Not by default: spread over workers, every
# kind of test meets every other, and on CI's 2 cores 3 workers took longer than one (issue #29: 50
# against 46 minutes); the two lanes pair the waiting kinds with the rest.
workers=${HPCRL_TEST_WORKERS:-0}
main=0
.venv/bin/python -m pytest -ra --durations=25 -n "$workers" --dist loadscope --no-loadscope-reorder \
  "${main_only[@]}" "$@" || main=$?
if [ -n "$side" ]; then
  lane=0
  wait "$side" || lane=$?
  side=""
  echo "Run beside the rest: $([ "$LANES" = 1 ] && echo "the side lane (${SIDE_LANE[*]}), then ")the GPU tier:"
  cat "$side_log"
  [ "$main" -ne 0 ] || main=$lane
fi
exit "$main"
