"""The trainer role's entry (hpcrl.compute.launch runs it on every trainer task): build the
trainer's parts from the job spec and the launch context, train, and report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hpcrl.compute.launch import outcome as job_outcome
from hpcrl.compute.launch.context import LaunchContext
from hpcrl.compute.train import checkpoint as ckpt
from hpcrl.compute.train.trainer import Trainer, TrainerSetup
from hpcrl.job import metric_keys as mk
from hpcrl.job import rundir
from hpcrl.job.errors import UserError
from hpcrl.job.rundir import FINISHED_MARKER

__all__ = ["run_trainer"]


def run_trainer(ctx: LaunchContext) -> int:
    """The trainer role's entry (hpcrl.compute.launch): build everything from the job spec, then train."""
    from hpcrl.compute.inference.client import ServerGenerator
    from hpcrl.compute.metrics import MetricsWriter
    from hpcrl.compute.train.engine import engine_class
    from hpcrl.compute.train.reward_model import load_reward_model
    from hpcrl.compute.train.sources import (job_model_dir, load_dataset, load_eval_dataset, load_tokenizer,
                                             local_or_cached)

    recipe = ctx.spec.recipe
    threads = recipe.trainer.threads or max(1, len(ctx.task.cores))
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.grpo.seed)
    device = torch.device("cuda", 0) if ctx.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_tf32(recipe.grpo.tf32, device)
    rank0 = ctx.task.trainer_rank == 0
    model_dir = job_model_dir(ctx.spec, ctx.run_dir)
    ckpt.control_group(ctx.launch.collective_timeout_s)      # a collective: every trainer, up front
    trainer_nodes = _trainer_nodes(ctx)
    readers = None
    if ctx.spec.node_model_dir() is not None:
        # A staged model: each node's first trainer reads its node's copy for the node's trainers.
        readers = [[r for r, n in enumerate(trainer_nodes) if n == node] for node in sorted(set(trainer_nodes))]
    t0 = time.perf_counter()
    engine, reference = engine_class(recipe.trainer.engine).build(ctx, model_dir, device, readers)
    policy = engine.sync_module
    if rank0:
        where = f"each node's own copy at {model_dir}" if readers else model_dir
        ctx.log(f"model loaded in {time.perf_counter() - t0:.1f} s from {where}")
        ctx.log(engine.describe())
    writer = MetricsWriter(ctx.run_dir, 0, tensorboard=recipe.logging.tensorboard,
                           wandb=recipe.logging.wandb, run_name=recipe.name) if rank0 else None
    # A reward model's hub id resolves to its cached snapshot, as model.path's does.
    reward_models = {i: load_reward_model(local_or_cached(r.model, f"rewards[{i}].model"), ctx.mesh, device, recipe,
                                          name=Path(r.model).name)
                     for i, r in enumerate(recipe.rewards) if r.model}
    generator = ServerGenerator(ctx, policy)
    setup = TrainerSetup(
        recipe=recipe, run_dir=Path(ctx.run_dir), device=device, policy=policy, reference=reference,
        tokenizer=load_tokenizer(recipe.model, model_dir), dataset=load_dataset(recipe.data, recipe.grpo.seed),
        eval_dataset=load_eval_dataset(recipe.data, recipe.grpo.seed) if recipe.grpo.eval_strategy != "no" else None,
        trainer_rank=ctx.task.trainer_rank, num_trainers=ctx.plan.num_trainers, log=ctx.log,
        collective_timeout_s=ctx.launch.collective_timeout_s, model_dir=model_dir,
        on_metrics=(lambda step, m: (writer.log(step, m), _print_step(ctx, step, m))) if rank0 else None,
        on_completions=writer.log_completions if rank0 else None, reward_models=reward_models,
        on_heartbeat=(lambda step, phase: writer.heartbeat(step, phase, servers=_server_health(ctx.run_dir)))
        if rank0 else None,
        trainer_nodes=trainer_nodes, engine=engine,
    )
    generator.wait_ready()
    trainer = Trainer(setup, generator)
    resume_step = trainer.resume_step_hint() if rank0 else None
    if rank0:
        # Steps past the checkpoint are done again; with no checkpoint (an attempt killed before its
        # first) every step is, and the killed attempt's lines go.
        writer.truncate_after(resume_step or 0)
    try:
        outcome = trainer.run()
    finally:
        trainer.rollouts.close()        # an agent's tool workers
        generator.close()
    if rank0:
        writer.heartbeat(trainer.step, outcome, servers=_server_health(ctx.run_dir))
        writer.close()
        if outcome == "finished":
            (Path(ctx.run_dir) / FINISHED_MARKER).write_text(f"{trainer.step}\n")
        ctx.log(f"{outcome} at step {trainer.step}")
        if outcome == "stopped":
            _ready_to_requeue(ctx, trainer.step, began_at=resume_step or 0)
        _log_balance(ctx)
    return 0


def _ready_to_requeue(ctx: LaunchContext, step: int, began_at: int) -> None:
    """Tell the batch script a requeue will resume somewhere new; else say why it would not."""
    if step > began_at:
        (Path(ctx.run_dir) / rundir.REQUEUE_READY_MARKER).write_text(f"{step}\n")
        return
    job_outcome.fatal(f"hpcrl: stopped at step {step}, where this attempt began: no step fits between start-up "
                      f"and the stop signal, so a requeue would only repeat this; not requeued (ask for more "
                      f"--time, or a smaller site.signal lead)")


def _log_balance(ctx: LaunchContext) -> None:
    """The run summary's advice on the split of each node's GPUs (hpcrl.job.balance)."""
    from hpcrl.job.balance import from_run

    balance, per_node = from_run(ctx.run_dir, gpus_per_node=ctx.spec.site.node.gpus,
                                 server_gpus=ctx.plan.server_gpus, tensor_parallel_size=ctx.plan.tensor_parallel_size,
                                 overlapped=ctx.spec.recipe.inference.staleness > 0)
    for line in per_node:
        ctx.log(line)
    if balance is not None:
        ctx.log(balance.advice())


def _trainer_nodes(ctx: LaunchContext) -> tuple[int, ...]:
    """The node of each trainer rank (in the trainers' process group), from the plan."""
    trainers = sorted((t for t in ctx.plan.tasks if t.trainer_rank is not None), key=lambda t: t.trainer_rank)
    return tuple(t.node for t in trainers)


def _print_step(ctx: LaunchContext, step: int, m: dict) -> None:
    def f(key, fmt):
        v = m.get(key)
        return "-" if v is None else format(v, fmt)
    if mk.eval_key(mk.REWARD) in m:
        per_func_prefix = mk.eval_key("rewards/")
        per_func = "  ".join(f"{k[len(per_func_prefix):].removesuffix('/mean')} {v:.3f}" for k, v in m.items()
                             if k.startswith(per_func_prefix) and k.endswith("/mean") and isinstance(v, float))
        ctx.log(f"eval {step:>4}  reward {f(mk.eval_key(mk.REWARD), '.3f')}  {per_func}  "
                f"len {f(mk.eval_key(mk.COMPLETIONS_MEAN_LENGTH), '.1f')}  in {f(mk.TIME_EVAL_S, '.1f')}s")
        if step == 0:
            return          # eval_on_start: no training step to show
    ctx.log(f"step {step:>4}  reward {f(mk.REWARD, '.3f')}  kl {f(mk.KL, '.4f')}  loss {f(mk.LOSS, '.4f')}  "
            f"len {f(mk.COMPLETIONS_MEAN_LENGTH, '.1f')}  gen {f(mk.TIME_GENERATION_S, '.2f')}s  "
            f"train {f(mk.TIME_TRAIN_S, '.2f')}s  sync {f(mk.TIME_SYNC_S, '.3f')}s")


def _server_health(run_dir) -> dict:
    """Every engine's health file, by rundir.server_key."""
    out = {}
    for path in (Path(run_dir) / rundir.SERVERS_DIR).glob("node-*.json"):
        try:
            data = json.loads(path.read_text())
            out[rundir.server_key(data["node"], data["engine_index"])] = data
        except (OSError, ValueError, KeyError):
            continue
    return dict(sorted(out.items(), key=lambda kv: rundir.server_key_order(kv[0])))


def set_tf32(enable: bool | None, device) -> None:
    """grpo.tf32 as transformers' TrainingArguments sets it (torch's fp32 precision, "tf32" or
    "ieee"), on an NVIDIA GPU of Ampere or newer; where there is none, True is the recipe's mistake
    (the login node refuses it on sites without NVIDIA GPUs) and False changes nothing."""
    if enable is None:
        return
    if torch.version.cuda is None or torch.cuda.get_device_capability(device)[0] < 8:
        if enable:
            raise UserError(f"grpo.tf32: {torch.cuda.get_device_name(device)} has no TF32 (NVIDIA Ampere or "
                            f"newer): leave it unset")
        return
    torch.backends.fp32_precision = "tf32" if enable else "ieee"
