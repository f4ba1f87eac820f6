"""The GRPO training loop of one trainer rank: generate -> reward -> advantages -> loss -> step -> sync.

A plain loop in the manner of torchtitan. Everything it needs comes in through `TrainerSetup`
(built by `run_trainer` from the job spec and the launch context), and it talks to generation only
through the `Generator` interface (hpcrl.compute.inference.types): the node's server in a job, an
in-process engine in tests.

Steps count optimizer steps (TRL's global_step). With num_iterations = mu, one generation feeds mu
optimizer steps; weights are pushed to generation before the next generation is due.

With inference.overlap_generation the next generation is asked for as soon as the current one is
in hand, so the server samples it while the trainers train: its completions come from the weights
one generation older than the policy that trains on them (one-step off-policy;
grpo.vllm_importance_sampling_correction reweights for it). The trainer takes it before pushing
new weights, so a sync never meets a generation in flight.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpcrl.compute.inference.types import Completion, Generator, PendingGeneration, Sampling, check_version
from hpcrl.compute.launch import faults
from hpcrl.compute.launch.stop import STOP
from hpcrl.job import rundir
from hpcrl.job.rundir import FINISHED_MARKER
from hpcrl.compute.train import checkpoint as ckpt
from hpcrl.compute.train import data as data_mod
from hpcrl.compute.train import grpo
from hpcrl.compute.train.optim import build_optimizer, build_scheduler, clip_grad_norm, current_lr
from hpcrl.compute.train.rewards import RewardFunction, as_completions, load_reward_functions, score_completions


@dataclass
class TrainerSetup:
    recipe: Any                      # hpcrl.job.recipe.Recipe
    run_dir: Path
    device: torch.device
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    tokenizer: Any
    dataset: Any
    trainer_rank: int
    num_trainers: int
    group: Any = None                # torch.distributed group of all trainers (None = default)
    log: Callable[[str], None] = print
    on_metrics: Callable[[int, dict], None] | None = None    # rank 0: where a step's metrics go
    on_heartbeat: Callable[[int, str], None] | None = None
    collective_timeout_s: float = 600.0


@dataclass
class Requested:
    """A generation asked for: its prompts, the weight version its completions must carry, and the
    generator's handle until the completions are taken."""
    batch: data_mod.PromptBatch
    version: int
    pending: PendingGeneration | None
    completions: list[Completion] | None = None
    wait_s: float = 0.0         # time the trainer was blocked on it: the generation it could not hide

    def take(self) -> list[Completion]:
        if self.completions is None:
            t0 = time.perf_counter()
            completions = self.pending.result()
            self.wait_s += time.perf_counter() - t0
            check_version(completions, self.version)
            self.completions, self.pending = completions, None
        return self.completions

    def state_dict(self) -> dict:
        assert self.completions is not None, "a generation in flight cannot be checkpointed: take() it first"
        return {"batch": self.batch, "version": self.version, "completions": self.completions}

    @classmethod
    def from_state(cls, state: dict | None) -> "Requested | None":
        return None if state is None else cls(state["batch"], state["version"], None, state["completions"])


def _any_true(flag: bool, group) -> bool:
    """True on every rank when any rank's flag is raised (a stop request seen by one rank stops all)."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _global_sum(values: list[float], group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()


def pack_batch(prompt_ids: list[list[int]], completions: list[Completion], pad_id: int, device):
    """prompt (left padded) + completion (right padded) -> tensors for the forward pass."""
    p_len = max(len(p) for p in prompt_ids)
    c_len = max(1, max(len(c.token_ids) for c in completions))
    b = len(completions)
    prompt = torch.full((b, p_len), pad_id, dtype=torch.long)
    p_mask = torch.zeros((b, p_len), dtype=torch.long)
    comp = torch.full((b, c_len), pad_id, dtype=torch.long)
    c_mask = torch.zeros((b, c_len), dtype=torch.long)
    sampling_logps = torch.zeros((b, c_len), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        prompt[i, p_len - len(p):] = torch.tensor(p)
        p_mask[i, p_len - len(p):] = 1
        if c.token_ids:
            comp[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
            c_mask[i, :len(c.token_ids)] = 1
            if c.logprobs:
                sampling_logps[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    ids = torch.cat([prompt, comp], 1)
    mask = torch.cat([p_mask, c_mask], 1)
    # Positions count real tokens only, as the engines did while sampling (left padding shifts them).
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, position_ids=positions,
                                             completion_ids=comp, completion_mask=c_mask,
                                             sampling_logps=sampling_logps).items()}


def completion_logps(model, batch: dict, temperature: float, rows=slice(None)) -> torch.Tensor:
    t = batch["completion_ids"].shape[1]
    out = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                position_ids=batch["position_ids"][rows], logits_to_keep=t + 1, use_cache=False)
    return grpo.completion_logprobs(out.logits, batch["completion_ids"][rows], temperature)


class Trainer:
    def __init__(self, setup: TrainerSetup, generator: Generator):
        self.s = setup
        self.r = setup.recipe
        self.g = setup.recipe.grpo
        self.generator = generator
        self.rewards: list[RewardFunction] = load_reward_functions(
            [{"func": r.func, "weight": r.weight} for r in self.r.rewards])
        self.optimizer = build_optimizer(setup.policy, self.g)
        self.scheduler = build_scheduler(self.optimizer, self.g)
        per_rank = self.g.per_device_train_batch_size * self.g.gradient_accumulation_steps
        self.prompts_per_rank = per_rank // self.g.num_generations
        self.sampler = data_mod.PromptSampler(setup.dataset, self.prompts_per_rank * setup.num_trainers,
                                              seed=self.g.seed, shuffle=self.r.data.shuffle,
                                              rank=setup.trainer_rank, world_size=setup.num_trainers)
        self.step = 0
        self.weight_version = 0        # the version generation serves; bumped by every push
        # The generation being trained on (num_iterations > 1): its inputs and how many of its
        # optimizer steps are done. A checkpoint taken in its middle keeps it, so a resume finishes it.
        self.generation: dict | None = None
        self.last_sync_stats: dict = {}
        self.overlap = self.r.inference.overlap_generation
        self.next: Requested | None = None      # asked for ahead of its turn (overlap_generation)
        self.ckpt_dir = Path(self.r.checkpoint.dir or setup.run_dir / rundir.CHECKPOINTS_DIR)
        self.flag = STOP

    # ------------------------------------------------------------------ checkpoints
    def resume_step_hint(self) -> int | None:
        """The step a resume will continue from (None: a fresh run)."""
        latest = ckpt.latest_checkpoint(self.ckpt_dir)
        return None if latest is None else ckpt.checkpoint_step(latest)

    def resume(self) -> bool:
        latest = ckpt.latest_checkpoint(self.ckpt_dir)
        if latest is None:
            return False
        extra = ckpt.load(latest, self.s.policy, self.optimizer, self.scheduler,
                          timeout_s=self.s.collective_timeout_s)
        self.step = int(extra["step"])
        self.sampler.load_state_dict(extra["sampler"])
        self.generation = _to_device(extra.get("generation"), self.s.device)
        self.next = Requested.from_state(extra.get("next"))
        self.s.log(f"resumed from {latest} at step {self.step}")
        return True

    def save(self) -> Path:
        t0 = time.perf_counter()
        if self.next is not None:
            self.next.take()        # a checkpoint keeps completions, never a request in flight
        path = ckpt.save(self.ckpt_dir, self.step, self.s.policy, self.optimizer, self.scheduler,
                         extra={"sampler": self.sampler.state_dict(),
                                "generation": _to_device(self.generation, torch.device("cpu")),
                                # A generation asked for ahead is kept whole: the sampler is past
                                # its prompts, and a resume trains on exactly these completions.
                                "next": None if self.next is None else self.next.state_dict()},
                         keep=self.r.checkpoint.keep,
                         timeout_s=self.s.collective_timeout_s)
        if self.s.trainer_rank == 0:
            self.s.log(f"checkpoint {path.name} written in {time.perf_counter() - t0:.1f} s")
        return path

    # ------------------------------------------------------------------ one generation
    def _request(self, first_step: int) -> Requested:
        """Ask for the generation that training starts on at optimizer step `first_step`."""
        idx = next(self.sampler)
        batch = data_mod.make_batch(self.s.dataset, idx, self.s.tokenizer)
        # A seed per (step, rank): generation is reproducible, so a resumed run repeats itself.
        sampling = Sampling(n=self.g.num_generations, max_tokens=self.g.max_completion_length,
                            temperature=self.g.temperature, top_p=self.g.top_p, top_k=self.g.top_k,
                            seed=self.g.seed * 100_003 + first_step * 1_009 + self.s.trainer_rank)
        t0 = time.perf_counter()
        pending = self.generator.submit(batch.prompt_ids, sampling)
        return Requested(batch, self.weight_version, pending, wait_s=time.perf_counter() - t0)

    def _ask_ahead(self, steps_left_in_generation: int) -> None:
        """Overlap: ask for the next generation now, if the run will train on it."""
        next_first_step = self.step + steps_left_in_generation
        if self.overlap and self.next is None and next_first_step < self.g.max_steps:
            self.next = self._request(next_first_step)

    def _score(self, batch, completions) -> tuple[torch.Tensor, torch.Tensor, dict]:
        texts = [c.text for c in completions]
        per_func = score_completions(
            self.rewards, batch.prompts, as_completions(batch.prompts, texts),
            [list(c.token_ids) for c in completions], batch.columns)
        # Whole groups live on one rank (spec validation), so advantages are local.
        advantages, local = grpo.compute_advantages(per_func, self.g.num_generations,
                                                    [rf.weight for rf in self.rewards], self.g.scale_rewards)
        stats = self._reward_stats(per_func, local["frac_reward_zero_std"])
        return per_func, advantages, stats

    def _reward_stats(self, per_func: torch.Tensor, frac_zero_std: float) -> dict:
        """Mean/std over all trainers' completions, overall and per reward function, and the share
        of completions whose group's rewards were all alike (no learning signal), as TRL logs them."""
        weights = torch.tensor([rf.weight for rf in self.rewards])
        total = grpo.combine_rewards(per_func, weights)
        cols = [total] + [per_func[:, i] for i in range(per_func.shape[1])]
        sums = []
        for c in cols:
            ok = ~torch.isnan(c)
            sums += [c[ok].sum().item(), (c[ok] ** 2).sum().item(), ok.sum().item()]
        sums += [frac_zero_std, 1.0]        # every rank scores as many completions: average over ranks
        sums = _global_sum(sums, self.s.group)
        out = {}
        names = ["reward"] + [f"rewards/{rf.name}" for rf in self.rewards]
        for k, name in enumerate(names):
            s, sq, n = sums[3 * k:3 * k + 3]
            mean = s / n if n else float("nan")
            out[name] = mean
            if k == 0:
                out["reward_std"] = math.sqrt(max(0.0, sq / n - mean * mean)) if n else float("nan")
        out["frac_reward_zero_std"] = sums[-2] / sums[-1]
        return out

    # ------------------------------------------------------------------ one optimizer step
    def _train_step(self, batch: dict, advantages: torch.Tensor, old_logps, ref_logps, tokens_global) -> dict:
        g = self.g
        model = self.s.policy
        model.train()
        rows = batch["input_ids"].shape[0]
        micro = g.per_device_train_batch_size
        metrics: dict[str, grpo.Metric] = {}
        loss_sum = 0.0
        for start in range(0, rows, micro):
            sl = slice(start, start + micro)
            logps = completion_logps(model, batch, g.temperature, sl)
            weights = None
            if g.vllm_importance_sampling_correction:
                weights, is_metrics = grpo.sampling_importance_ratio(
                    old_logps[sl] if old_logps is not None else logps.detach(), batch["sampling_logps"][sl],
                    batch["completion_mask"][sl], mode=g.vllm_importance_sampling_mode,
                    clip_min=g.vllm_importance_sampling_clip_min, clip_max=g.vllm_importance_sampling_clip_max)
                _merge(metrics, is_metrics)
            loss, m = grpo.grpo_loss(
                logps, None if old_logps is None else old_logps[sl],
                None if ref_logps is None else ref_logps[sl], advantages[sl], batch["completion_mask"][sl],
                loss_type=g.loss_type, beta=g.beta, epsilon_low=g.epsilon, epsilon_high=g.epsilon_high,
                max_completion_length=g.max_completion_length, num_items_in_batch=tokens_global,
                num_processes=self.s.num_trainers, gradient_accumulation_steps=g.gradient_accumulation_steps,
                importance_weights=weights)
            loss.backward()
            loss_sum += loss.item()
            _merge(metrics, m)
        grad_norm = clip_grad_norm(model.parameters(), g.max_grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.s.log(f"step {self.step + 1}: non-finite gradient norm {grad_norm}; step skipped")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = grpo.reduce_metrics(metrics, self.s.group)
        loss_t = _global_sum([loss_sum], self.s.group)[0]
        out.update(loss=loss_t, grad_norm=grad_norm)
        return out

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        """Train to max_steps; returns "finished" or "stopped" (a signal asked for a checkpoint)."""
        g, s = self.g, self.s
        mu = g.num_iterations
        resumed = self.resume()
        self.weight_version = self.step
        if resumed:
            self._push(self.step)        # the server starts from the model directory's weights
        while self.step < g.max_steps:
            if _any_true(self.flag.raised, s.group):
                self.save()
                return "stopped"
            faults.at_step()
            t_step = time.perf_counter()
            t_gen = t_logps = 0.0
            fresh = self.generation is None     # else: resumed in the middle of a generation
            if fresh:
                if s.on_heartbeat:
                    s.on_heartbeat(self.step, "generating")
                requested = self.next or self._request(self.step)
                self.next = None
                completions = requested.take()
                self._ask_ahead(mu)
                batch = requested.batch.repeat(self.g.num_generations)
                t_gen, lag = requested.wait_s, self.weight_version - requested.version
                per_func, advantages, rstats = self._score(batch, completions)
                tensors = pack_batch(batch.prompt_ids, completions, _pad_id(s.tokenizer), s.device)
                advantages = advantages.to(s.device)
                local_tokens = tensors["completion_mask"].sum().item()
                gen_tokens = _global_sum([local_tokens, len(completions),
                                          sum(c.truncated for c in completions)], s.group)
                t_logps0 = time.perf_counter()
                with torch.no_grad():
                    old_logps = None
                    if mu > 1 or g.vllm_importance_sampling_correction:
                        s.policy.eval()
                        old_logps = completion_logps(s.policy, tensors, g.temperature)
                    ref_logps = completion_logps(s.reference, tensors, g.temperature) if s.reference is not None else None
                t_logps = time.perf_counter() - t_logps0      # counted as training time of the first step
                self.generation = dict(tensors=tensors, advantages=advantages, old_logps=old_logps,
                                       ref_logps=ref_logps, gen_tokens=gen_tokens, rstats=rstats, done=0,
                                       lag=lag)
            gen = self.generation
            tensors, advantages, old_logps, ref_logps = gen["tensors"], gen["advantages"], gen["old_logps"], gen["ref_logps"]
            gen_tokens, rstats = gen["gen_tokens"], gen["rstats"]
            tokens_global = gen_tokens[0]
            if s.on_heartbeat:
                s.on_heartbeat(self.step, "training")
            start = gen["done"]
            self._ask_ahead(mu - start)         # (a resume in the middle of a generation)
            for it in range(start, mu):
                if self.step >= g.max_steps:
                    break
                first = fresh and it == start
                t_train0 = time.perf_counter()
                m = self._train_step(tensors, advantages, old_logps, ref_logps, tokens_global)
                self.step += 1
                gen["done"] = it + 1
                t_train = time.perf_counter() - t_train0 + (t_logps if first else 0.0)
                t_sync = 0.0
                last_of_generation = it == mu - 1 or self.step >= g.max_steps
                if it == mu - 1:
                    self.generation = None      # spent: the next loop generates
                if last_of_generation and self.step < g.max_steps and (self.step // mu) % self.r.inference.sync_every == 0:
                    if self.next is not None:
                        self.next.take()    # the server finishes it before it takes weights
                    t_sync = self._push(self.step)
                metrics = {
                    "step": self.step, "time": time.time(), **rstats, **m,
                    "advantage_mean": advantages.mean().item(), "advantage_std": advantages.std().item(),
                    "completion_len_mean": tokens_global / max(1, gen_tokens[1]),
                    "truncated_frac": gen_tokens[2] / max(1, gen_tokens[1]),
                    "learning_rate": current_lr(self.optimizer), "weight_version": self.weight_version,
                    # How many weight versions the completions trained on are behind the policy.
                    "off_policy_lag": gen.get("lag", 0),
                    "time_generation_s": t_gen if first else 0.0, "time_train_s": t_train,
                    "time_sync_s": t_sync, "sync_s": t_sync if t_sync else None,
                }
                if t_sync:
                    # The job's gather traffic for this sync: under HSDP nothing crosses a node.
                    metrics.update({f"sync_{k}": v for k, v in self.last_sync_stats.items()})
                step_time = time.perf_counter() - t_step
                metrics["time_step_s"] = step_time
                metrics["time_wait_s"] = max(0.0, step_time - metrics["time_generation_s"] - t_train - t_sync)
                metrics["tokens_per_s"] = tokens_global / step_time if first else None
                t_step = time.perf_counter()
                if s.on_metrics:
                    s.on_metrics(self.step, metrics)
                every = self.r.checkpoint.every
                if every and self.step % every == 0 and self.step < g.max_steps:
                    self.save()
        self.save()         # the end state, for `hpcrl submit --resume` with more steps
        return "finished"

    def _push(self, version: int) -> float:
        t0 = time.perf_counter()
        if self.s.on_heartbeat:
            self.s.on_heartbeat(self.step, "syncing")
        stats = self.generator.push_weights(self.s.policy, version) or {}
        self.weight_version = version
        self.last_sync_stats = stats
        return time.perf_counter() - t0


def _merge(into: dict, new: dict) -> None:
    """Accumulate metric partials over micro-batches: sums for means, extremes for min/max."""
    for k, m in new.items():
        old = into.get(k)
        if old is None:
            into[k] = m
        elif m.op == "mean":
            into[k] = grpo.Metric(old.value + m.value, torch.as_tensor(old.count) + torch.as_tensor(m.count), "mean")
        else:
            pick = torch.minimum if m.op == "min" else torch.maximum
            into[k] = grpo.Metric(pick(old.value, m.value), old.count, m.op)


def _to_device(obj, device):
    """Tensors in nested dicts/lists moved to ``device`` (a checkpointed generation goes via the host)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---------------------------------------------------------------------- the trainer role
def run_trainer(ctx) -> int:
    """The trainer role's entry (hpcrl.compute.launch): build everything from the job spec, then train."""
    from transformers import AutoTokenizer

    from hpcrl.compute.inference.client import ServerGenerator
    from hpcrl.compute.metrics import MetricsWriter
    from hpcrl.compute.train.fsdp import describe, load_policy_and_reference
    from hpcrl.compute.train.sources import load_dataset, resolve_model

    recipe = ctx.spec.recipe
    threads = recipe.trainer.threads or max(1, len(ctx.task.cores))
    torch.set_num_threads(threads)
    torch.manual_seed(recipe.grpo.seed)
    device = torch.device("cuda", 0) if ctx.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank0 = ctx.task.trainer_rank == 0
    model_dir = resolve_model(recipe.model.path, ctx.run_dir, recipe.grpo.seed)
    ckpt.control_group(ctx.launch.collective_timeout_s)      # a collective: every trainer, up front
    policy, reference = load_policy_and_reference(model_dir, ctx.mesh, device, recipe)
    if rank0:
        ctx.log(describe(policy))
    writer = MetricsWriter(ctx.run_dir, 0, tensorboard=recipe.logging.tensorboard,
                           wandb=recipe.logging.wandb, run_name=recipe.name) if rank0 else None
    generator = ServerGenerator(ctx, policy)
    setup = TrainerSetup(
        recipe=recipe, run_dir=Path(ctx.run_dir), device=device, policy=policy, reference=reference,
        tokenizer=AutoTokenizer.from_pretrained(model_dir), dataset=load_dataset(recipe.data, recipe.grpo.seed),
        trainer_rank=ctx.task.trainer_rank, num_trainers=ctx.plan.num_trainers, log=ctx.log,
        collective_timeout_s=ctx.launch.collective_timeout_s,
        on_metrics=(lambda step, m: (writer.log(step, m), _print_step(ctx, step, m))) if rank0 else None,
        on_heartbeat=(lambda step, phase: writer.heartbeat(step, phase, servers=_server_health(ctx.run_dir)))
        if rank0 else None,
    )
    generator.wait_ready()
    trainer = Trainer(setup, generator)
    resume_step = trainer.resume_step_hint() if rank0 else None
    if resume_step is not None:
        writer.truncate_after(resume_step)
    try:
        outcome = trainer.run()
    finally:
        generator.close()
    if rank0:
        writer.heartbeat(trainer.step, outcome, servers=_server_health(ctx.run_dir))
        writer.close()
        if outcome == "finished":
            (Path(ctx.run_dir) / FINISHED_MARKER).write_text(f"{trainer.step}\n")
        ctx.log(f"{outcome} at step {trainer.step}")
    return 0


def _print_step(ctx, step: int, m: dict) -> None:
    def f(key, fmt):
        v = m.get(key)
        return "-" if v is None else format(v, fmt)
    ctx.log(f"step {step:>4}  reward {f('reward', '.3f')}  kl {f('kl', '.4f')}  loss {f('loss', '.4f')}  "
            f"len {f('completion_len_mean', '.1f')}  gen {f('time_generation_s', '.2f')}s  "
            f"train {f('time_train_s', '.2f')}s  sync {f('time_sync_s', '.3f')}s")


def _server_health(run_dir) -> dict:
    import json

    out = {}
    for path in (Path(run_dir) / rundir.SERVERS_DIR).glob("node-*.json"):
        try:
            data = json.loads(path.read_text())
            out[str(data["node"])] = data
        except (OSError, ValueError, KeyError):
            continue
    return out
