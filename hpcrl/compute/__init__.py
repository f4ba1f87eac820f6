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

import logging

# Where torchao is installed (grpo.optim adamw_torch_8bit), transformers imports it with its
# quantizers, and at import it logs that its CUDA kernels (mxfp8, cutlass) cannot load on a CPU or
# ROCm torch, and torch that two of its enums need no registration: nothing hpcrl uses, in every
# task's log and every command's output (an `hpcrl export` error was one line among five).
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
