"""The GRPO training loop of one trainer rank: generate -> reward -> advantages -> loss -> step -> sync.

A plain loop in the manner of torchtitan. Everything it needs comes in through `TrainerSetup`
(built by hpcrl.compute.train.role.run_trainer from the job spec and the launch context), and it
talks to generation only through the `Generator` interface (hpcrl.compute.inference.types): the
node's server in a job, an in-process engine in tests. A generation's parts live beside it:
hpcrl.compute.train.generation (what is asked for and trained on), hpcrl.compute.train.scoring (its
rewards, advantages and statistics), hpcrl.compute.train.batch (its tensors and log-probabilities);
hpcrl.compute.train.loss is the loss its optimizer steps take.

Steps count optimizer steps (TRL's global_step). One generation holds steps_per_generation
micro-batches per trainer (gradient_accumulation_steps unless set: one optimizer step's worth); its
optimizer steps take its slices in turn, num_iterations times over. Weights are pushed to generation
before the next generation is due.

With inference.overlap_generation the next generation is asked for as soon as the current one is
in hand, so the server samples it while the trainers train: its completions come from the weights
one generation older than the policy that trains on them (one-step off-policy;
grpo.vllm_importance_sampling_correction reweights for it). The trainer takes it before pushing
new weights, so a sync never meets a generation in flight.

inference.max_staleness = k > 1 keeps k generations asked for ahead and pushes weights while they are
in flight, which the engines take between two generations (weight_update = in_flight: two engine
steps). A completion is trained on at most k syncs after its oldest token, and a resume drops those
ahead of its checkpoint (hpcrl.compute.train.ahead).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpcrl.compute.inference.types import Generator, Sampling
from hpcrl.compute.launch import faults
from hpcrl.compute.launch.stop import STOP
from hpcrl.job import metric_keys as mk
from hpcrl.job import rundir
from hpcrl.job.recipe import LaunchConfig, Recipe
from hpcrl.compute.train import checkpoint as ckpt
from hpcrl.compute.train import data as data_mod
from hpcrl.compute.train import model_options
from hpcrl.compute.train.ahead import Ahead
from hpcrl.compute.train.base_diff import BaseDiff
from hpcrl.compute.train.batch import micro_batched_logps, pack_batch, policy_forward, router_aux_coef
from hpcrl.compute.train.engine import TrainEngine
from hpcrl.compute.train.entropy_control import EntropyControl
from hpcrl.compute.train.fsdp import Fsdp2Engine
from hpcrl.compute.train.evaluation import Evaluator, epoch_ended, eval_due
from hpcrl.compute.train.generation import Generation, Requested, updated_in_flight
from hpcrl.compute.train.loss import (LossConfig, SamplerCorrection, effective_sample_size, grpo_loss,
                                      high_entropy_mask, sampling_importance_ratio)
from hpcrl.compute.train.rank_metrics import Metric, global_sum, merge_metrics, reduce_metrics
from hpcrl.compute.train.rewards import RewardFunction, load_reward_functions, new_trainer_state
from hpcrl.compute.train.rollouts import context_len, make_rollouts
from hpcrl.compute.train.scoring import Scorer


@dataclass
class TrainerSetup:
    recipe: Recipe
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
    on_completions: Callable[[list[dict]], None] | None = None     # rank 0: logging.log_completions' rows
    eval_dataset: Any = None         # data.eval_split, when grpo.eval_strategy evaluates
    # rewards[i].model's scorers (hpcrl.compute.train.reward_model), by i: sharded, so loaded with the mesh
    reward_models: dict[int, Callable] = field(default_factory=dict)
    on_heartbeat: Callable[[int, str], None] | None = None
    collective_timeout_s: float = LaunchConfig.collective_timeout_s
    # The source model directory (config, generation config, code) of the Hugging Face model
    # directories the run writes; None: the run writes none (in-process tests).
    model_dir: str | None = None
    # The node of each trainer rank (the plan's): with it each step logs every node's mean wait
    # for generation (time_generation_s_by_node); () = not logged (in-process tests).
    trainer_nodes: tuple[int, ...] = ()
    # What steps the policy (hpcrl.compute.train.engine): None = FSDP2 over ``policy`` as loaded.
    engine: TrainEngine | None = None


def _any_true(flag: bool, group) -> bool:
    """True on every rank when any rank's flag is raised (a stop request seen by one rank stops all)."""
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def epoch_steps(grpo, prompts: int, prompts_per_generation: int, steps_per_generation: int) -> int:
    """Optimizer steps of grpo.num_train_epochs passes over ``prompts`` (grpo.max_steps -1), as TRL
    counts them: every generation of ``prompts_per_generation`` prompts trains
    ``steps_per_generation`` optimizer steps, and a fraction of an epoch is rounded up to whole
    generations."""
    generations = math.ceil(grpo.num_train_epochs * prompts / prompts_per_generation)
    return max(1, generations * steps_per_generation)


class Trainer:
    def __init__(self, setup: TrainerSetup, generator: Generator):
        self.setup = setup
        grpo = setup.recipe.grpo
        # A generation: this many completions per trainer, sliced into optimizer steps of step_rows.
        self.step_rows = grpo.completions_per_trainer_step
        generation_rows = grpo.per_device_train_batch_size * grpo.micro_batches_per_generation(setup.num_trainers)
        self.slices = generation_rows // self.step_rows
        self.steps_per_generation = grpo.optimizer_steps_per_generation(setup.num_trainers)
        self.prompts_per_rank = generation_rows // grpo.num_generations
        if grpo.max_steps == -1:
            grpo = replace(grpo, max_steps=epoch_steps(grpo, len(setup.dataset), self.prompts_per_rank * setup.num_trainers,
                                                       self.steps_per_generation))
        self.recipe = replace(setup.recipe, grpo=grpo)
        self.grpo = grpo
        self.generator = generator
        # A rollout per completion: the engines' completion itself, or a conversation with tools.
        self.rollouts = make_rollouts(self.recipe, generator, setup.tokenizer, setup.run_dir,
                                      context_len(self.recipe, setup.policy, setup.tokenizer), log=setup.log)
        self.rewards: list[RewardFunction] = load_reward_functions(
            [{"func": setup.reward_models[i], "weight": r.weight, "name": r.name} if r.model else
             {"func": r.func, "weight": r.weight, "name": r.name, "kwargs": r.kwargs}
             for i, r in enumerate(self.recipe.rewards)],
            module_dir=setup.run_dir / rundir.REWARDS_DIR) + self.rollouts.reward_functions()
        self.epochs_per_step = (self.prompts_per_rank * setup.num_trainers
                                / (self.steps_per_generation * max(1, len(setup.dataset))))
        # What the reward functions get as trainer_state (the scorer fills it in, a checkpoint keeps it).
        self.trainer_state = new_trainer_state(self.grpo, 1 / self.epochs_per_step, setup.trainer_rank == 0)
        self.scorer = Scorer(setup, self.recipe, self.rewards, self.trainer_state, self.epochs_per_step)
        self.loss_config = LossConfig.from_grpo(self.grpo, setup.num_trainers)
        self.entropy = EntropyControl(self.grpo)        # the bonus's coefficient, adaptive or not
        self.router_aux_coef = router_aux_coef(setup.policy, grpo.router_aux_loss_coef)
        model_options.apply(setup.policy, setup.reference, self.grpo)     # dropout, NEFTune
        self.engine = setup.engine or Fsdp2Engine(setup.policy)
        self.engine.configure(self.grpo)
        self.sampler = data_mod.PromptSampler(setup.dataset, self.prompts_per_rank * setup.num_trainers,
                                              seed=self.grpo.seed, shuffle=self.recipe.data.shuffle,
                                              rank=setup.trainer_rank, world_size=setup.num_trainers)
        self.step = 0
        self.weight_version = 0        # the version generation serves; bumped by every push
        # The generation being trained on (more than one step each) and how many of its optimizer steps
        # are done. A checkpoint taken in its middle keeps both, so a resume finishes it.
        self.generation: Generation | None = None
        self.generation_steps_done = 0
        self.last_sync_stats: dict = {}
        # Generations asked for ahead of their turn (overlap_generation: one; max_staleness: k).
        self.staleness = self.recipe.inference.staleness
        self.ahead = Ahead(self.staleness, self._request, log=setup.log)
        self.ckpt_dir = Path(self.recipe.checkpoint.dir or setup.run_dir / rundir.CHECKPOINTS_DIR)
        self.logprob_chunk_tokens = self.recipe.trainer.logprob_chunk_tokens
        self.evaluator = None if setup.eval_dataset is None else Evaluator(
            setup.eval_dataset, setup.tokenizer, self.rollouts, self.rewards, self.grpo, setup.trainer_rank,
            setup.num_trainers, setup.group)
        self.flag = STOP

    @property
    def completion_extra(self) -> dict[str, list]:
        """The reward functions' log_extra columns of the generation scored last (this rank's)."""
        return self.scorer.completion_extra

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def scheduler(self):
        return self.engine.scheduler

    # ------------------------------------------------------------------ the loop
    def run(self) -> str:
        """Train to max_steps; returns "finished" or "stopped" (a signal asked for a checkpoint)."""
        self._start()
        if self.step == 0 and self._eval_due() and self.setup.on_metrics:
            self.setup.on_metrics(0, {"step": 0, "max_steps": self.grpo.max_steps, "time": time.time(),
                                      **self._evaluate()})
        while self.step < self.grpo.max_steps:
            if self._stop_requested():
                if self.setup.trainer_rank == 0:
                    self.setup.log(f"stop requested ({self.flag.signal_name or 'by a peer'}) at step {self.step}: "
                                   f"checkpointing")
                self.save()
                return "stopped"
            faults.at_step()
            started = time.perf_counter()
            if self.generation is None:         # else: resumed in the middle of one
                self.generation = self._next_generation()
            self._train_on(self.generation, started)
        self.save()         # the end state, for `hpcrl submit --resume` with more steps
        final = self.save_model()
        if final is not None:
            self._link_last_model_checkpoint(final)
        return "finished"

    def _start(self) -> None:
        """Resume from the latest checkpoint, if there is one, and then give generation its weights."""
        resumed = self.resume()
        self.weight_version = self.step
        if resumed:
            self._push(self.step)        # the server starts from the model directory's weights

    def _stop_requested(self) -> bool:
        # Agreed on by all trainers, so that every rank checkpoints the same step.
        return _any_true(self.flag.raised, self.setup.group)

    def _train_on(self, generation: Generation, started: float) -> None:
        """The optimizer steps still due on `generation`: its slices, num_iterations times over
        (steps_per_generation in all), fewer where max_steps comes first. `started`: when the first
        of them began (generating counts in it)."""
        mu = self.steps_per_generation
        self._heartbeat("training")
        # The generations after this one, asked for now (from a resume in the middle of a generation too).
        self.ahead.fill(self.step + mu - self.generation_steps_done, mu, self.grpo.max_steps)
        for it in range(self.generation_steps_done, mu):
            if self.step >= self.grpo.max_steps:
                break
            # A checkpointed generation has at least one step done, so only a generation made in
            # this process has a first step, which carries the time spent making it.
            first = it == 0
            t0 = time.perf_counter()
            start = it % self.slices * self.step_rows
            losses = self._optimizer_step(generation, slice(start, start + self.step_rows))
            self.step += 1
            self.generation_steps_done = it + 1
            train_s = time.perf_counter() - t0 + (generation.logps_s if first else 0.0)
            sync_s = 0.0
            if it == mu - 1:
                self.generation, self.generation_steps_done = None, 0     # spent: the next loop generates
                # A stop skips the sync: the engine may be draining its last requests (SIGTERM), and a
                # resume pushes the checkpoint's weights anyway.
                if self._sync_due() and not self._stop_requested():
                    sync_s = self._sync_weights()
            metrics = self._step_metrics(generation, losses, first=first, train_s=train_s, sync_s=sync_s,
                                         started=started)
            if self._eval_due():
                metrics.update(self._evaluate())
            started = time.perf_counter()
            if self.setup.on_metrics:
                self.setup.on_metrics(self.step, metrics)
            self._checkpoint_if_due()
            self._save_model_if_due()

    def _heartbeat(self, phase: str) -> None:
        if self.setup.on_heartbeat:
            self.setup.on_heartbeat(self.step, phase)

    # ------------------------------------------------------------------ checkpoints
    def resume_step_hint(self) -> int | None:
        """The step a resume will continue from (None: a fresh run)."""
        latest = ckpt.latest_checkpoint(self.ckpt_dir)
        return None if latest is None else ckpt.checkpoint_step(latest)

    def resume(self) -> bool:
        latest = ckpt.latest_checkpoint(self.ckpt_dir)
        if latest is None:
            return False
        extra = self.engine.load(latest, timeout_s=self.setup.collective_timeout_s)
        self.step = int(extra["step"])
        self.sampler.load_state_dict(extra["sampler"])
        self.trainer_state.num_input_tokens_seen = int(extra.get("tokens_seen", 0))
        self.entropy.load_state_dict(extra.get("entropy_control"))
        state = extra.get("generation")
        self.generation = Generation.from_state(state, self.setup.device)
        self.generation_steps_done = 0 if state is None else int(state["done"])
        dropped = self.ahead.load_state_dict(extra)
        self._load_reference_shards(extra.get("reference"))
        self.setup.log(f"resumed from {latest} at step {self.step}" + (dropped and f"; dropped its {dropped} "
                       f"generation(s) asked for ahead (never trained on): their prompts are asked for again" or ""))
        return True

    def _reference_shards(self) -> list[torch.Tensor] | None:
        if not (self.grpo.sync_ref_model and self.setup.reference is not None):
            return None
        return [p.detach().to("cpu", copy=True) for p in self.engine.local_parts(self.setup.reference)]

    @torch.no_grad()
    def _load_reference_shards(self, shards: list[torch.Tensor] | None) -> None:
        if shards is None or not (self.grpo.sync_ref_model and self.setup.reference is not None):
            return
        local = self.engine.local_parts(self.setup.reference)
        if len(local) != len(shards) or any(a.shape != b.shape for a, b in zip(local, shards)):
            raise RuntimeError("the checkpoint's reference model (grpo.sync_ref_model) was sharded over another "
                               "number of trainers; resume with the trainers it was written with")
        for p, s in zip(local, shards):
            p.copy_(s)

    def save(self) -> Path:
        t0 = time.perf_counter()
        generation = None if self.generation is None else self.generation.state_dict(self.generation_steps_done)
        extra = {"sampler": self.sampler.state_dict(),
                 "tokens_seen": self.trainer_state.num_input_tokens_seen, "generation": generation,
                 "entropy_control": self.entropy.state_dict(),
                 **self.ahead.state_dict(),
                 # grpo.sync_ref_model moves the reference: this rank's shards of it.
                 "reference": self._reference_shards()}
        path = self.engine.save(self.ckpt_dir, self.step, extra, keep=self.recipe.checkpoint.keep,
                                timeout_s=self.setup.collective_timeout_s)
        if self.setup.trainer_rank == 0:
            self.setup.log(f"checkpoint {path.name} written in {time.perf_counter() - t0:.1f} s")
        return path

    def _checkpoint_if_due(self) -> None:
        # The last step is saved by run() itself, whatever checkpoint.every says.
        every = self.recipe.checkpoint.every
        if every and self.step % every == 0 and self.step < self.grpo.max_steps:
            self.save()

    # ------------------------------------------------------------------ the trained model out
    def save_model(self, step: int | None = None) -> Path | None:
        """The policy as a Hugging Face directory: <run_dir>/model (step None: the end of the run),
        <run_dir>/model/checkpoint-<step> (grpo.save_steps). Every trainer calls it (hpcrl.compute.train.export)."""
        if self.setup.model_dir is None:
            return None
        from hpcrl.compute.train import export

        t0 = time.perf_counter()
        self._heartbeat("saving model")
        out = rundir.model_dir(self.setup.run_dir, step, self.recipe.checkpoint.output_dir)
        how = export.ModelWriting.for_run(self.recipe, self.setup.model_dir, self.setup.tokenizer)
        writer, policy = self.setup.trainer_rank == 0, self.engine.sync_module
        diff = None
        if self.recipe.model.use_peft:
            export.save_lora_from_trainers(policy, out, how, recipe_model=self.recipe.model, writer=writer,
                                           merged=self.recipe.checkpoint.save_merged_model, group=self.setup.group)
        else:
            # The final model against the base: did the run change anything the file keeps?
            diff = BaseDiff(self.setup.model_dir) if step is None and writer else None
            export.save_from_trainers(policy, out, how, writer=writer, group=self.setup.group,
                                      on_tensor=diff and diff.add)
        if self.setup.trainer_rank == 0:
            self.setup.log(f"model written to {out} in {time.perf_counter() - t0:.1f} s")
        if diff is not None:
            self._report_base_diff(diff.close())
        return out

    def _report_base_diff(self, result) -> None:
        result.save(self.setup.run_dir / rundir.MODEL_VS_BASE_FILE)
        if result.compared and not result.changed:
            self.setup.log(f"warning: the model written equals the base model in all {result.compared} tensors "
                           f"({result.dtype}): no update survived the export")

    def _save_model_if_due(self) -> None:
        # The last step's model is the final one, written by run() at <run_dir>/model.
        if self.step < self.grpo.max_steps and self._model_checkpoint_due():
            self.save_model(self.step)
            self._prune_model_checkpoints()

    def _model_checkpoint_due(self) -> bool:
        """grpo.save_strategy, as TRL's: "steps" every save_steps and at the last step, "epoch" at the
        end of each pass over the prompts."""
        g = self.grpo
        if g.save_strategy == "epoch":
            return epoch_ended(self.step, self.epochs_per_step, g.max_steps)
        return g.save_strategy == "steps" and g.save_steps > 0 and (self.step % g.save_steps == 0
                                                                     or self.step == g.max_steps)

    def _link_last_model_checkpoint(self, final: Path) -> None:
        """TRL also saves the last step as checkpoint-<step>, and save_total_limit keeps the newest
        ones: that checkpoint is the final model, so its files are hard links to the final model's
        (no second write of the weights)."""
        if self.setup.trainer_rank != 0 or not self._model_checkpoint_due():
            return
        dest = rundir.model_dir(self.setup.run_dir, self.step, self.recipe.checkpoint.output_dir)
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:             # a file system without hard links
                shutil.copy2(src, dst)

        shutil.copytree(final, tmp, copy_function=link,
                        ignore=shutil.ignore_patterns(f"{rundir.MODEL_CHECKPOINT_PREFIX}*"))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        self._prune_model_checkpoints()

    def _prune_model_checkpoints(self) -> None:
        """grpo.save_total_limit, as TRL's: only the newest checkpoint-<step> model directories stay."""
        limit = self.grpo.save_total_limit
        if not limit or self.setup.trainer_rank != 0 or self.setup.model_dir is None:
            return
        output_dir = self.recipe.checkpoint.output_dir
        final = rundir.model_dir(self.setup.run_dir, None, output_dir)
        for step in rundir.model_checkpoint_steps(final)[:-limit]:
            shutil.rmtree(rundir.model_dir(self.setup.run_dir, step, output_dir), ignore_errors=True)

    # ------------------------------------------------------------------ one generation
    def _request(self, first_step: int, batch: data_mod.PromptBatch | None = None) -> Requested:
        """Ask for the generation training starts on at step `first_step` (of `batch`: a resume's, again)."""
        if batch is None:
            batch = data_mod.make_batch(self.setup.dataset, next(self.sampler), self.setup.tokenizer,
                                        **(self.grpo.chat_template_kwargs or {}))
        # A seed per (step, rank): generation is reproducible, so a resumed run repeats itself.
        sampling = Sampling.of(self.grpo, self.grpo.num_generations,
                               seed=self.grpo.seed * 100_003 + first_step * 1_009 + self.setup.trainer_rank)
        t0 = time.perf_counter()
        rows, pending = self.rollouts.submit(batch, sampling)
        return Requested(batch, self.weight_version, pending, wait_s=time.perf_counter() - t0, rows=rows)

    def _next_generation(self) -> Generation:
        """The generation due now (asked for ahead, or asked for here), scored and ready to train on;
        the one after it is asked for as soon as this one's completions are in hand."""
        setup = self.setup
        self._heartbeat("generating")
        requested, completions, staleness = self.ahead.next(self.step)
        self.ahead.fill(self.step + self.steps_per_generation, self.steps_per_generation, self.grpo.max_steps)
        self._heartbeat("scoring")      # not waiting for the engines: a slow reward is not slow generation
        batch = requested.rollout_rows(self.grpo.num_generations)
        lag = self.weight_version - min((c.weight_version for c in completions), default=self.weight_version)
        advantages, reward_stats = self.scorer.score(batch, completions, self.step)
        tensors = pack_batch(batch.prompt_ids, completions, _pad_id(setup.tokenizer), setup.device,
                             mask_truncated=self.grpo.mask_truncated_completions)
        advantages = advantages.to(setup.device)
        tokens, loss_tokens, count, truncated = self.scorer.counts(completions, tensors["loss_mask"].sum().item())
        t0 = time.perf_counter()
        old_logps, ref_logps = self._old_and_ref_logps(tensors)
        return Generation(tensors=tensors, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps,
                          completion_tokens=tokens, loss_tokens=loss_tokens, completions=count, truncated=truncated,
                          reward_stats=reward_stats, lag=lag, wait_s=requested.wait_s,
                          staleness=(sum(staleness) / max(1, len(staleness)), max(staleness, default=0)),
                          logps_s=time.perf_counter() - t0, updated_in_flight=updated_in_flight(completions))

    @torch.no_grad()
    def _old_and_ref_logps(self, tensors: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The log-probabilities that stay fixed while a generation is trained on: the policy's
        before its first step (the ratio's denominator; on-policy with one iteration and no sampling
        correction, the ratio is 1 and they are not needed) and the reference model's (the KL's)."""
        setup = self.setup
        old_logps = None
        if self.steps_per_generation > 1 or self.grpo.vllm_importance_sampling_correction:
            self.engine.model.eval()
            old_logps = self._micro_batched_logps(self.engine.model, tensors)
        ref_logps = self._micro_batched_logps(setup.reference, tensors) if setup.reference is not None else None
        return old_logps, ref_logps

    def _micro_batched_logps(self, model, tensors: dict) -> torch.Tensor:
        return micro_batched_logps(model, tensors, self.grpo.temperature, self.grpo.per_device_train_batch_size,
                                   self.logprob_chunk_tokens)

    # ------------------------------------------------------------------ one optimizer step
    def _optimizer_step(self, generation: Generation, rows: slice | None = None) -> dict:
        """Forward and backward over the generation's ``rows`` (all: one step's worth) in
        micro-batches, then one optimizer step; returns the step's loss metrics, reduced over all
        trainers."""
        cfg = self.grpo
        model = self.engine.model
        batch, advantages = generation.tensors, generation.advantages
        old_logps, ref_logps = generation.old_logps, generation.ref_logps
        model.train()
        rows = rows or slice(0, batch["input_ids"].shape[0])
        micro = cfg.per_device_train_batch_size
        metrics: dict[str, Metric] = {}
        loss_sum = 0.0
        loss_config = replace(self.loss_config, entropy_coef=self.entropy.applied())
        for start in range(rows.start, min(rows.stop, batch["input_ids"].shape[0]), micro):
            sl = slice(start, start + micro)
            # Entropies only for the entropy bonus and mask: they cost a pass over the vocabulary.
            want_entropy = self.entropy.enabled or cfg.top_entropy_quantile < 1.0
            out = policy_forward(model, batch, cfg.temperature, sl, self.logprob_chunk_tokens,
                                 entropy=want_entropy, router_aux=self.router_aux_coef != 0.0)
            logps, entropies = out.logps, out.entropies
            entropy_mask = None
            if cfg.top_entropy_quantile < 1.0:
                entropy_mask = high_entropy_mask(entropies.detach(), batch["loss_mask"][sl],
                                                 1 - cfg.top_entropy_quantile, self.setup.group)
            weights = None
            if cfg.vllm_importance_sampling_correction:
                weights, is_metrics = sampling_importance_ratio(
                    old_logps[sl] if old_logps is not None else logps.detach(), batch["sampling_logps"][sl],
                    batch["loss_mask"][sl], mode=cfg.vllm_importance_sampling_mode,
                    clip_min=cfg.vllm_importance_sampling_clip_min, clip_max=cfg.vllm_importance_sampling_clip_max)
                merge_metrics(metrics, is_metrics)
            # The engines always return the sampled tokens' log-probabilities (TRL's with vLLM).
            loss, m = grpo_loss(
                logps, None if old_logps is None else old_logps[sl], None if ref_logps is None else ref_logps[sl],
                advantages[sl], batch["loss_mask"][sl], loss_config,
                num_items_in_batch=generation.loss_tokens, entropies=entropies, entropy_mask=entropy_mask,
                sampler=SamplerCorrection(batch["sampling_logps"][sl], weights))
            if out.aux_loss is not None:
                # TRL's: the policy loss is already scaled for accumulation, so the aux loss is too.
                loss = loss + self.router_aux_coef * out.aux_loss / cfg.gradient_accumulation_steps
                merge_metrics(metrics, {mk.AUX_LOSS: Metric(out.aux_loss.detach().float())})
            if entropies is not None:
                acting = batch["loss_mask"][sl] if entropy_mask is None else batch["loss_mask"][sl] * entropy_mask
                self.entropy.observe(entropies, acting)
            self.engine.backward(loss)
            loss_sum += loss.item()
            merge_metrics(metrics, m)
        lr_used = self.engine.learning_rate()     # the schedule steps inside engine.step
        grad_norm = self.engine.step(cfg.max_grad_norm)
        self.entropy.step_done(self.setup.group)
        if not math.isfinite(grad_norm):
            self.setup.log(f"step {self.step + 1}: non-finite gradient norm {grad_norm}; step skipped")
        if cfg.sync_ref_model and self.setup.reference is not None and (self.step + 1) % cfg.ref_model_sync_steps == 0:
            # TRL's SyncRefModelCallback at the end of optimizer step self.step + 1.
            self.engine.mix_into_reference(self.setup.reference, cfg.ref_model_mixup_alpha)
        out = reduce_metrics(metrics, self.setup.group)
        effective_sample_size(out)
        loss_t = global_sum([loss_sum], self.setup.group)[0]
        out.update({mk.LOSS: loss_t, mk.GRAD_NORM: grad_norm, mk.LEARNING_RATE_USED: lr_used})
        if self.entropy.enabled:
            out[mk.ENTROPY_COEF] = self.entropy.coef        # TRL's: after the step's update
        return out

    def _step_metrics(self, gen: Generation, losses: dict, *, first: bool, train_s: float,
                      sync_s: float, started: float) -> dict:
        """The step's metrics. The first step on a generation carries the time spent making it.
        time_step_s runs from the previous step's metrics (from the start of the generation for its
        first step), so time_wait_s holds what no phase accounts for: scoring, packing, reporting,
        checkpoints."""
        metrics = {
            mk.STEP: self.step, mk.MAX_STEPS: self.grpo.max_steps, mk.TIME: time.time(), **gen.reward_stats, **losses,
            mk.ADVANTAGE_MEAN: gen.advantages.mean().item(), mk.ADVANTAGE_STD: gen.advantages.std().item(),
            mk.COMPLETIONS_MEAN_LENGTH: gen.completion_tokens / max(1, gen.completions),
            mk.COMPLETIONS_CLIPPED_RATIO: gen.truncated / max(1, gen.completions),
            mk.NUM_TOKENS: self.trainer_state.num_input_tokens_seen,
            mk.LEARNING_RATE: self.engine.learning_rate(), mk.EPOCH: self.step * self.epochs_per_step,
            # How many weight versions the completions trained on are behind the policy.
            mk.WEIGHT_VERSION: self.weight_version, mk.OFF_POLICY_LAG: gen.lag,
            mk.STALENESS_MEAN: gen.staleness[0], mk.STALENESS_MAX: gen.staleness[1],
            mk.DROPPED_STALE_TOTAL: self.ahead.dropped,
            mk.UPDATED_IN_FLIGHT: gen.updated_in_flight if self.recipe.inference.in_flight else None,
            mk.TIME_GENERATION_S: gen.wait_s if first else 0.0, mk.TIME_TRAIN_S: train_s,
            mk.TIME_SYNC_S: sync_s, mk.SYNC_S: sync_s if sync_s else None,
        }
        if first and self.setup.trainer_nodes:
            metrics[mk.TIME_GENERATION_S_BY_NODE] = self._wait_by_node(gen.wait_s)
        if sync_s:
            # The job's gather traffic for this sync: under HSDP nothing crosses a node.
            metrics.update({f"sync_{k}": v for k, v in self.last_sync_stats.items()})
        step_s = time.perf_counter() - started
        metrics[mk.TIME_STEP_S] = step_s
        metrics[mk.TIME_WAIT_S] = max(0.0, step_s - metrics[mk.TIME_GENERATION_S] - train_s - sync_s)
        metrics[mk.TOKENS_PER_S] = gen.completion_tokens / step_s if first else None
        return metrics

    def _wait_by_node(self, wait_s: float) -> list[float]:
        """Every node's mean wait for generation (a collective): nodes whose engine is slower show."""
        nodes = self.setup.trainer_nodes
        mine = nodes[self.setup.trainer_rank]
        slots = [0.0] * (max(nodes) + 1)
        slots[mine] = wait_s / nodes.count(mine)
        return [round(x, 4) for x in global_sum(slots, self.setup.group)]

    # ------------------------------------------------------------------ weights to generation
    def _eval_due(self) -> bool:
        return self.evaluator is not None and eval_due(self.grpo, self.step, self.epochs_per_step)

    def _evaluate(self) -> dict:
        """eval_... metrics of the weights as they are after this step (TRL evaluates the model it
        trains): the server gets them first if it has older ones."""
        if self.weight_version != self.step:
            self._sync_weights()
        self._heartbeat("evaluating")
        t0 = time.perf_counter()
        metrics = self.evaluator.run(self.trainer_state)
        metrics["time_eval_s"] = time.perf_counter() - t0
        return metrics

    def _sync_due(self) -> bool:
        """After a generation is spent: every inference.sync_every generations, unless training is over."""
        return (self.step < self.grpo.max_steps
                and (self.step // self.steps_per_generation) % self.recipe.inference.sync_every == 0)

    def _sync_weights(self) -> float:
        """Push the policy to generation; returns the seconds the push took."""
        if self.staleness <= 1 and not self.recipe.inference.in_flight:
            # Overlap: the generation ahead is sampled with the weights it was asked under, one sync
            # behind. Beyond (or in flight), the engines take the weights while generations are under way.
            self.ahead.take_all()
        return self._push(self.step)

    def _push(self, version: int) -> float:
        t0 = time.perf_counter()
        self._heartbeat("syncing")
        with self.rollouts.paused_for_sync():
            stats = self.generator.push_weights(self.engine.sync_module, version) or {}
        self.weight_version = version
        self.ahead.pushed_version(version)
        self.last_sync_stats = stats
        return time.perf_counter() - t0


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
