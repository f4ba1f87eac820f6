"""DeepSpeed ZeRO-3 as a trainer engine (trainer.engine deepspeed), beside FSDP2.

The GRPO loop is the FSDP2 one (hpcrl.compute.train.trainer); what differs is here:

- Loading: the model is built under ``deepspeed.zero.Init`` (each parameter partitioned as its
  module is made, weights not initialised: they are loaded next), then streamed from one reader
  per group into each rank's partition (hpcrl.compute.train.loading), so no rank ever holds the
  model; with a staged model each node reads its own copy.
- Training: ``deepspeed.initialize`` over hpcrl's own AdamW (hpcrl.compute.train.optim, TRL's
  meaning of grpo.*), in DeepSpeed's unmanaged accumulation mode (a backward per micro-batch, one
  ``step`` per optimizer step: the loss is already scaled for accumulation, as FSDP2's is).
  Clipping is DeepSpeed's (``gradient_clipping`` = grpo.max_grad_norm); a non-finite norm skips
  the step there too. The learning-rate schedule is hpcrl's, stepped after every optimizer step.
- The reference model (grpo.beta > 0): a ZeRO-3 inference engine, partitioned on the devices like
  the policy; in host memory only with trainer.reference_offload (DeepSpeed's ``offload_param``).
- Weight sync and the Hugging Face export walk the module's parameters as FSDP2's do; each ZeRO-3
  parameter is gathered by its handle (hpcrl.compute.train.deepspeed_params.Zero3Param, through
  hpcrl.compute.partitioned), one at a time inside the bucketing, in the wire dtype: never the whole model (the trap of unwrapping a ZeRO-3 model to
  feed an inference engine).
- Checkpoints: DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` inside hpcrl's checkpoint
  directory (hpcrl.compute.train.checkpoint: the same atomic commit, latest pointer, RNG, sampler
  and resume semantics). DeepSpeed's ZeRO-3 checkpoints load on the number of trainers that
  wrote them; the export reads them with DeepSpeed's own zero_to_fp32 (``checkpoint_tensors``).

The config passed to DeepSpeed is built on the login node's terms (hpcrl.job.deepspeed), so what
a user's DeepSpeed JSON says was checked against the recipe before the job queued.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from hpcrl.compute.train import deepspeed_params  # noqa: F401  (registers ZeRO-3's parameter handle)
from hpcrl.compute.train.engine import StoredTensors, TrainEngine
from hpcrl.job import rundir
from hpcrl.job.recipe import GRPOConfig, Recipe

if TYPE_CHECKING:
    from hpcrl.compute.launch.context import LaunchContext

__all__ = ["DeepSpeedEngine", "build_partitioned_model", "check_partition_devices", "load_policy_and_reference",
           "reference_config"]

# DeepSpeed's checkpoint files go in <checkpoint>/deepspeed: its "tag" is that directory's name.
_TAG = rundir.DEEPSPEED_STATE_DIR


def _import_deepspeed():
    # DeepSpeed chooses its device from LOCAL_RANK. hpcrl's pinning gives every task one GPU, which
    # the task sees as device 0 whatever its place on the node, so 0 is the right answer for all.
    os.environ["LOCAL_RANK"] = "0"
    import deepspeed
    import deepspeed.ops

    # On CPU, DeepSpeed's communication backend compiles a shared-memory all-reduce (a C++ build
    # at every new machine) that only its inference all-reduce uses, which hpcrl never calls:
    # marked unavailable, the build and its compiler are not needed.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    # DeepSpeed 0.19.8's ZeRO-3 calls torch.distributed's deprecated all_gather_into_tensor and
    # reduce_scatter_tensor; the FutureWarning came back at every call (four a step on every rank,
    # ~800 lines in the demo's log) and is DeepSpeed's to act on, not the user's.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

    # On hpcrl's trainers' process group (made by the launch): DeepSpeed only wraps it. Before
    # this, its config checks count a world of one.
    deepspeed.init_distributed(dist_init_required=False)
    return deepspeed


def _dtype(config: dict) -> torch.dtype:
    return torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32


def reference_config(config: dict, offload: bool) -> dict:
    """The reference model's DeepSpeed config: the policy's ZeRO-3 without an optimizer or its
    offload; its parameters in host memory only when trainer.reference_offload asks."""
    ref = copy.deepcopy(config)
    zero = ref.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    for key in ("optimizer", "scheduler"):
        ref.pop(key, None)
    return ref


def build_partitioned_model(model_dir: str, config: dict, *, trust_remote_code: bool = False,
                            attn_implementation: Optional[str] = None, activation_checkpointing: bool = False
                            ) -> nn.Module:
    """The model of ``model_dir`` built under ``zero.Init``: every parameter is a partition from the
    moment its module exists; no weight is initialised (the checkpoint is streamed in next)."""
    deepspeed = _import_deepspeed()
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    hf_config.use_cache = False         # the trainer only runs whole sequences
    dtype = _dtype(config)
    # no_init_weights first: transformers' own ZeRO-3 path orders them so (an init of an empty
    # partition fails). zero.Init takes its dtype from the config's bf16 switch: given dtype=fp32
    # on a CPU without fp16 kernels, DeepSpeed 0.19 stores bf16 (an operator-precedence slip).
    with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 attn_implementation=attn_implementation)
    model.tie_weights()         # no_init_weights skipped it with the init (tied embeddings: one partition)
    if activation_checkpointing:
        from hpcrl.compute.train.fsdp import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    return model


def _load_into(model: nn.Module, model_dir: str, config: dict, *, group, recipe: Recipe) -> None:
    """Stream ``model_dir``'s weights into ``model``'s partitions: the group's first rank reads."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.loading import load_device, load_group, stream_from_rank0

    timeout = recipe.launch.model_load_timeout_s
    load_group(group, timeout)          # made before the reader reads: its making is a rendezvous too
    source = None
    if dist.get_rank(group) == 0:
        source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(config),
                                                      trust_remote_code=recipe.model.trust_remote_code,
                                                      attn_implementation=recipe.model.attn_implementation or None)
    stream_from_rank0(model, source, load_device(), group, what=model_dir, load_timeout_s=timeout)
    del source


def check_partition_devices(model: nn.Module, config: dict, *, what: str) -> None:
    """Every ZeRO-3 partition of ``model`` where ``config`` puts it: on this task's GPU, in host
    memory only when the config offloads the parameters (``offload_param``); FSDP2's check."""
    from hpcrl.compute.train.loading import check_devices, load_device

    check_devices({p.ds_tensor.device for p in model.parameters()}, load_device(),
                  offload="offload_param" in config.get("zero_optimization", {}), what=what, parts="ZeRO-3 partitions")


def load_policy_and_reference(model_dir: str, recipe: Recipe, config: dict,
                              read_groups: Optional[list[list[int]]] = None
                              ) -> tuple[nn.Module, Optional[nn.Module]]:
    """The policy (a partitioned module; ``DeepSpeedEngine`` wraps it) and, when grpo.beta > 0,
    the reference model as a ZeRO-3 inference engine in eval mode.

    ``read_groups``: the trainers of each node, when every node has its own copy of ``model_dir``
    (each node's first trainer reads it for the node alone)."""
    import torch.distributed as dist

    from hpcrl.compute.train.loading import read_group

    group = dist.group.WORLD if read_groups is None else read_group(read_groups)
    grpo, trainer = recipe.grpo, recipe.trainer
    build = dict(trust_remote_code=recipe.model.trust_remote_code,
                 attn_implementation=recipe.model.attn_implementation or None)
    policy = build_partitioned_model(model_dir, config, activation_checkpointing=bool(
        grpo.gradient_checkpointing or trainer.activation_checkpointing), **build)
    _load_into(policy, model_dir, config, group=group, recipe=recipe)
    check_partition_devices(policy, config, what="policy")
    policy.train()
    if grpo.beta <= 0:
        return policy, None
    ref_config = reference_config(config, bool(trainer.reference_offload))
    reference = build_partitioned_model(model_dir, ref_config, **build)
    _load_into(reference, model_dir, ref_config, group=group, recipe=recipe)
    check_partition_devices(reference, ref_config, what="reference")
    reference.requires_grad_(False)
    deepspeed = _import_deepspeed()
    engine, *_ = deepspeed.initialize(model=reference, config=ref_config, dist_init_required=False)
    engine.eval()
    return policy, engine


class DeepSpeedEngine(TrainEngine):
    """ZeRO-3 over the partitioned ``policy`` (``load_policy_and_reference``); ``config``: the
    DeepSpeed config (hpcrl.job.deepspeed.build_config)."""

    name = "deepspeed"

    def __init__(self, policy: nn.Module, config: dict, partition: str = "") -> None:
        self.policy, self.config, self.partition = policy, config, partition
        self.ds: Any = None

    @classmethod
    def build(cls, ctx: LaunchContext, model_dir: str, device: torch.device,
              read_groups: Optional[list[list[int]]]) -> tuple[DeepSpeedEngine, Optional[nn.Module]]:
        from hpcrl.job.deepspeed import config_for_job, describe

        config = config_for_job(ctx.spec, device.type, hidden_size=_hidden_size(model_dir))
        policy, reference = load_policy_and_reference(model_dir, ctx.spec.recipe, config, read_groups=read_groups)
        return cls(policy, config, partition=describe(ctx.mesh_choice)), reference

    def describe(self) -> str:
        return self.partition

    @property
    def model(self) -> nn.Module:
        if self.ds is None:
            raise RuntimeError("DeepSpeedEngine.configure() has not run")
        return self.ds

    @property
    def sync_module(self) -> nn.Module:
        return self.policy

    def configure(self, grpo: GRPOConfig) -> None:
        deepspeed = _import_deepspeed()
        from hpcrl.compute.train.optim import build_optimizer, build_scheduler

        # hpcrl's AdamW, so that a step means what it means with FSDP2 (and TRL); DeepSpeed's ZeRO-3
        # optimizer steps it over each rank's fp32 partition.
        client = build_optimizer(self.policy, grpo)
        self.ds, _, _, _ = deepspeed.initialize(model=self.policy, optimizer=client, config=self.config,
                                                dist_init_required=False)
        self.optimizer = client
        self.scheduler = build_scheduler(client, grpo)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm: float) -> float:
        configured = float(self.config.get("gradient_clipping", 0.0))
        if max(0.0, max_grad_norm) != configured:
            raise RuntimeError(f"grpo.max_grad_norm {max_grad_norm} but DeepSpeed clips at {configured}")
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        self.scheduler.step()
        return float("nan") if norm is None else float(norm)

    def save(self, directory: Path, step: int, extra: dict, *, keep: int, timeout_s: float) -> Path:
        from hpcrl.compute.train import checkpoint as ckpt

        def write(tmp: Path) -> None:
            self.ds.save_checkpoint(str(tmp), tag=_TAG, client_state={}, save_latest=False)

        return ckpt.save(directory, step, self.policy, None, self.scheduler, extra=extra, keep=keep,
                         timeout_s=timeout_s, write_state=write)

    def load(self, path: Path, *, timeout_s: float) -> dict:
        from hpcrl.compute.train import checkpoint as ckpt

        self.ensure_wrote(path)

        def read(path: Path) -> None:
            loaded, _ = self.ds.load_checkpoint(str(path), tag=_TAG, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
            if loaded is None:
                raise ckpt.CheckpointError(f"{path}: DeepSpeed found no checkpoint in {path / _TAG}")

        return ckpt.load(path, self.policy, None, self.scheduler, timeout_s=timeout_s, read_state=read)

    @classmethod
    def wrote(cls, path: Path) -> bool:
        return (Path(path) / _TAG).is_dir()

    @classmethod
    def checkpoint_tensors(cls, path: Path) -> StoredTensors:
        """The checkpoint's fp32 weights through DeepSpeed's own zero_to_fp32 in its lazy mode: each
        tensor is put together from the ranks' partitions only when read."""
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=_TAG, lazy_mode=True)
        stored = {name: (tuple(t.shape), t.dtype) for name, t in lazy.items()}

        def read(entries: list[tuple[str, tuple[int, ...], torch.dtype]], track) -> dict[str, torch.Tensor]:
            return {name: track(lazy[name].contiguous()) for name, _, _ in entries}

        return stored, read

    def local_parts(self, model: nn.Module) -> list[torch.Tensor]:
        module = getattr(model, "module", model)        # the reference is a DeepSpeed engine
        return [p.ds_tensor for p in module.parameters()]


def _hidden_size(model_dir: str) -> Optional[int]:
    """The model's hidden size, which DeepSpeed's "auto" bucket sizes are made from (None: unknown)."""
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
