"""What runs inside a job: every task starts as `python -m hpcrl.compute.launch RUN_DIR`.

Reads the job spec (hpcrl.job) and nothing from hpcrl.login.

launch/     rendezvous, roles, pinning, the watchdog that bounds every wait, the node channel, the mesh
train/      the GRPO trainer: TRL's math, FSDP2, the loop, checkpoints
inference/  the per-node server (vLLM or transformers engine) and its client
agents/     multi-turn rollouts with tools and environments (TRL's tool loop), tools in worker processes
sync/       trainer -> server weights after each step: the ordered bucketed gather, one module per transport
models/     tiny models made locally (the demo; tests)
metrics.py  the metrics and heartbeat writer (trainer rank 0)
partitioned.py  the seam to a trainer engine's own parameter partitioning (ZeRO-3): gather, load, shape
stage.py    copies the job's model to each node's local storage before the launch (site.stage)
"""
