"""Resume: a run killed after step k and resumed from its checkpoint in new processes gives, for
steps k+1..n, the same metrics as an uninterrupted run (issue 4).

Three runs of the real `Trainer` loop (hpcrl.compute.train.trainer) on 2 gloo ranks (tests/dist_harness.py),
each rank with its own in-process transformers generator (tests/support.py: InProcessGenerator), a tiny random
model, the demo dataset and the demo rewards, a reference model (beta > 0, so KL is in the
metrics), a cosine schedule with warmup (so the scheduler state matters) and gradient accumulation:

  A  n steps, uninterrupted.
  B  the same run with a checkpoint every k steps; both ranks SIGKILL themselves in step k+1, after
     its optimizer step (the work since the step-k checkpoint is lost, as in a real crash).
  C  new processes, seeded differently from B (only what the checkpoint restores may matter),
     resume from B's checkpoint and train to step n.

Every metric of steps k+1..n but the timings must be equal (within 1e-6) in A and C; B's steps
1..k equal A's (saving a checkpoint changes nothing). With num_iterations = 2 the kill falls in the
middle of a generation (step 3 of the pairs 1-2, 3-4, 5-6): the resumed run must go on with the
same completions, old log-probabilities and advantages instead of generating anew.

With inference.overlap_generation the next generation is asked for while the current one trains;
the generator here samples only when the trainer takes the result (as a server samples while the
trainer trains), so a take after a weight push would carry the new version and show a lag of 0.
With inference.max_staleness=2 two are asked for ahead and sampled at once (an eager server), and
every completion is two syncs behind once the queue is full. Issue #31: a checkpoint keeps only the
prompts of the generations asked for ahead; the resumed run drops their completions (it says so)
and asks for the same prompts again at the checkpoint's weights. So its steps train on the same
prompts as the uninterrupted run's, each once, but from fresher weights: the staleness climbs from 0
again as at a fresh start, and the metrics after the resume differ.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
from dist_harness import spawn  # noqa: E402  (the gloo harness)
from support import InProcessGenerator, cpu_trainer_setup  # noqa: E402

N_STEPS = 6
K = 3
TOL = 1e-6
# Wall-clock figures: differ between any two runs, resumed or not.
TIMING_KEYS = {"time", "time_generation_s", "time_train_s", "time_sync_s", "sync_s", "time_step_s",
               "time_wait_s", "tokens_per_s"}


def _recipe(run_dir: str, every: int, mu: int, staleness: int, lora: bool = False, optim: str = "adamw_torch_fused"):
    from hpcrl.job.recipe import (CheckpointConfig, GRPOConfig, InferenceConfig, LoggingConfig, ModelConfig,
                                  Recipe)

    grpo = GRPOConfig(
        learning_rate=5e-3, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=8, beta=0.04, num_iterations=mu, max_steps=N_STEPS, warmup_steps=0.3,
        lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.01, seed=7, gradient_checkpointing=False,
        optim=optim,
        # Overlapped, the one-step lag is reweighted, with bounds other than the defaults.
        vllm_importance_sampling_correction=staleness > 0, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
    # LoRA: the checkpoint holds the adapters and their optimizer state only; dropout on the
    # adapters' inputs makes the restored RNG state matter too.
    model = ModelConfig(use_peft=True, lora_r=4, lora_alpha=16, lora_dropout=0.1,
                        lora_target_modules="all-linear") if lora else ModelConfig()
    return Recipe(model=model, grpo=grpo, logging=LoggingConfig(log_completions=1),
                  checkpoint=CheckpointConfig(every=every, keep=2, dir=str(Path(run_dir) / "ckpt")),
                  inference=InferenceConfig(overlap_generation=staleness == 1,
                                            max_staleness=staleness if staleness > 1 else 0))


class _SampledWhenTaken:
    """A generator whose completions are sampled when the trainer takes them, not when it asks."""

    def __init__(self, inner):
        self.inner = inner

    def submit(self, prompts, sampling):
        inner = self.inner

        class Later:
            def result(self):
                return inner.submit(prompts, sampling).result()

        return Later()

    def push_weights(self, model, version):
        return self.inner.push_weights(model, version)


def _append(path, line: str) -> None:
    with open(path, "a") as f:         # on disk before a later SIGKILL
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def record_metrics(rank: int, metrics_path, die_after: int | None):
    """A resume leg's on_metrics: rank 0 appends every step's line to metrics_path, durably; with
    die_after=k every rank is SIGKILLed as step k+1 is reported (before it is saved)."""
    def on_metrics(step, m):
        if die_after is not None and step == die_after + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 0:
            _append(metrics_path, json.dumps(m))
    return on_metrics


def record_prompts(metrics_path):
    """Rank 0's on_completions: the prompts every trainer trains on, each row with its first step,
    beside metrics_path."""
    def on_completions(rows):
        for row in rows:
            _append(f"{metrics_path}.prompts", json.dumps([row["step"], row["prompt"]]))
    return on_completions


def _w_run(rank, world, model_dir, run_dir, metrics_path, every, mu, staleness, die_after, seed, lora=False,
           engine_name="fsdp2", optim="adamw_torch_fused"):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from hpcrl.compute.inference.hf_engine import TransformersEngine
    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.trainer import Trainer

    torch.manual_seed(seed + rank)
    recipe = _recipe(run_dir, every, mu, staleness, lora, optim)
    ckpt.control_group(60)
    engine = None
    if engine_name == "deepspeed":
        from hpcrl.compute.train import deepspeed_engine
        from hpcrl.job.deepspeed import build_config

        config = build_config(recipe, num_trainers=world)
        policy, reference = deepspeed_engine.load_policy_and_reference(model_dir, recipe, config)
        engine = deepspeed_engine.DeepSpeedEngine(policy, config)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    assert reference is not None

    on_metrics = record_metrics(rank, metrics_path, die_after)
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world,
                              tokenizer=AutoTokenizer.from_pretrained(model_dir), on_metrics=on_metrics, engine=engine,
                              on_completions=record_prompts(metrics_path) if rank == 0 else None,
                              log=lambda line: rank == 0 and _append(f"{metrics_path}.log", line))
    generator = InProcessGenerator(TransformersEngine(model_dir, device="cpu", dtype="float32", seed=recipe.grpo.seed))
    trainer = Trainer(setup, _SampledWhenTaken(generator) if staleness == 1 else generator)
    outcome = trainer.run()
    assert outcome == "finished" and trainer.step == N_STEPS, (outcome, trainer.step)


def _w_whole_then_killed(rank, world, model_dir, runs, whole, first, mu, staleness, lora, engine_name, optim):
    """The uninterrupted run, then in the same processes the run killed after step K: a process
    start fewer per case (CI time, issue #29). Every object of the second is made anew and its seeds
    are set again, so it must repeat the first's steps 1..K exactly: state one run left in the
    process that changed the next would fail here."""
    _w_run(rank, world, model_dir, runs["whole"], whole, 0, mu, staleness, None, 100, lora, engine_name, optim)
    _w_run(rank, world, model_dir, runs["killed"], first, K, mu, staleness, K, 100, lora, engine_name, optim)


def _read(path: Path) -> dict[int, dict]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {m["step"]: m for m in steps}


FUSED = "adamw_torch_fused"


def _differences(a: dict, b: dict) -> list[str]:
    out = []
    for key in sorted((a.keys() | b.keys()) - TIMING_KEYS):
        x, y = a.get(key, "<missing>"), b.get(key, "<missing>")
        if isinstance(x, float) and isinstance(y, float):
            same = (math.isnan(x) and math.isnan(y)) or abs(x - y) <= TOL
        else:
            same = x == y
        if not same:
            out.append(f"{key}: {x!r} != {y!r}")
    return out


# mu1-8bit: grpo.optim adamw_torch_8bit, torchao's 8-bit moments, which the checkpoint holds
# dequantized and the resume quantizes again. It is the plain one-iteration case too (CI time: the
# default AdamW is every other case's).
@pytest.mark.parametrize("mu,staleness,lora,engine,optim", [
    (1, 0, False, "fsdp2", "adamw_torch_8bit"), (2, 0, False, "fsdp2", FUSED), (1, 1, False, "fsdp2", FUSED),
    (1, 2, False, "fsdp2", FUSED), (2, 0, True, "fsdp2", FUSED), (2, 0, False, "deepspeed", FUSED)],
    ids=["mu1-8bit", "mu2", "mu1-overlap", "mu1-staleness2", "mu2-lora", "mu2-deepspeed"])
def test_killed_and_resumed_run_repeats_the_uninterrupted_one(tmp_path, model_dir, mu, staleness, lora, engine, optim):
    runs = {name: tmp_path / name for name in ("whole", "killed")}
    for d in runs.values():
        d.mkdir()
    whole, first, second = tmp_path / "whole.jsonl", tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    spawn(_w_whole_then_killed, tmp_path / "a", model_dir, {k: str(v) for k, v in runs.items()}, str(whole),
          str(first), mu, staleness, lora, engine, optim, timeout=450, expect={0: -signal.SIGKILL, 1: -signal.SIGKILL})
    ckpt_dir = runs["killed"] / "ckpt"
    assert (ckpt_dir / "latest").read_text().strip() == f"step-{K}"
    assert (ckpt_dir / f"step-{K}" / "deepspeed").is_dir() == (engine == "deepspeed")
    if lora:        # the adapters and their optimizer state, not the frozen base
        import torch.distributed.checkpoint as dcp

        stored = dcp.FileSystemReader(str(ckpt_dir / f"step-{K}")).read_metadata().state_dict_metadata
        model_keys = [k for k in stored if k.startswith("model.")]
        assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
        assert all(".lora_" in k for k in stored if k.startswith("optim.state."))
    spawn(_w_run, tmp_path / "c", model_dir, str(runs["killed"]), str(second), K, mu, staleness, None, 555, lora,
          engine, optim, timeout=300)

    a, b, c = _read(whole), _read(first), _read(second)
    assert sorted(a) == list(range(1, N_STEPS + 1))
    assert sorted(b) == list(range(1, K + 1)), "the first leg was killed after step k"
    assert sorted(c) == list(range(K + 1, N_STEPS + 1)), "the second leg resumed at step k+1"
    # Overlapped, every generation but the first was sampled one weight version behind the policy;
    # with two ahead, two once the queue is full.
    lags = [a[s]["off_policy_lag"] for s in sorted(a)]
    assert lags == [min(s - 1, staleness) for s in sorted(a)], lags
    assert [a[s]["sample/staleness_max"] for s in sorted(a)] == lags
    if staleness:   # token_truncate at [0.5, 2.0]: every ratio inside the bounds, some moved off 1
        lo, hi = min(a[s]["sampling/importance_sampling_ratio/min"] for s in a), \
            max(a[s]["sampling/importance_sampling_ratio/max"] for s in a)
        assert 0.5 <= lo and hi <= 2.0 and (lo < 0.999 or hi > 1.001), (lo, hi)
    # TRL's share of groups with no learning signal, averaged over both trainers' groups.
    assert all(0.0 <= a[s]["frac_reward_zero_std"] <= 1.0 for s in a)
    # The run learns something at all: otherwise equal metrics would prove little.
    assert len({round(a[s]["loss"], 9) for s in a}) > 1 and any(a[s]["grad_norm"] > 0 for s in a)
    # The same prompts, step by step, each trained on once: the resumed leg's first steps train on
    # the prompts whose generations the checkpoint had asked for ahead.
    prompts = {name: _prompts(path) for name, path in (("a", whole), ("b", first), ("c", second))}
    assert min(prompts["a"]) == 1 and {**prompts["b"], **prompts["c"]} == prompts["a"]
    assert sorted(prompts["c"]) == [s for s in sorted(prompts["a"]) if s > K], (sorted(prompts["c"]), sorted(prompts["a"]))
    problems = [f"step {s} (checkpointing run): {d}" for s in range(1, K + 1) for d in _differences(a[s], b[s])]
    dropped = [line for line in (Path(f"{second}.log").read_text().splitlines()) if "asked for ahead" in line]
    if staleness:
        # Dropped at the resume, said once; then the staleness climbs from 0 again.
        assert len(dropped) == 1 and f"dropped its {staleness} generation(s)" in dropped[0], dropped
        lags = [c[s]["off_policy_lag"] for s in sorted(c)]
        assert lags == [min(j, staleness) for j in range(len(c))], lags
        assert not problems, "metrics differ from the uninterrupted run:\n" + "\n".join(problems)
        return
    assert not dropped, dropped
    problems += [f"step {s} (resumed): {d}" for s in range(K + 1, N_STEPS + 1) for d in _differences(a[s], c[s])]
    assert not problems, "metrics differ from the uninterrupted run:\n" + "\n".join(problems)
    worst = max(abs(a[s][k] - c[s][k]) for s in c for k in c[s].keys() - TIMING_KEYS
                if isinstance(c[s][k], float) and not math.isnan(c[s][k]))
    print(f"num_iterations={mu}: steps {K + 1}..{N_STEPS} after the resume, largest metric difference {worst:.3g}")


def _prompts(metrics_path: Path) -> dict[int, list[str]]:
    """The prompts trained on, by the first step of their generation (sorted: rows come by rank)."""
    out: dict[int, list[str]] = {}
    for line in Path(f"{metrics_path}.prompts").read_text().splitlines():
        step, prompt = json.loads(line)
        out.setdefault(step, []).append(prompt)
    return {step: sorted(p) for step, p in out.items()}


def test_a_generation_checkpointed_before_tool_masks_resumes_with_its_completion_mask_as_loss_mask():
    """A checkpoint written before pack_batch had loss_mask (no multi-turn rollouts then) resumes:
    its loss mask is its completion mask."""
    import torch

    from hpcrl.compute.inference.types import Completion
    from hpcrl.compute.train.batch import pack_batch
    from hpcrl.compute.train.generation import Generation

    completions = [Completion(0, (5, 6, 7), (-1.0,) * 3, "", False, 0), Completion(0, (5,), (-1.0,), "", False, 0)]
    tensors = pack_batch([[1, 2], [3]], completions, 0, "cpu")
    old = {k: v for k, v in tensors.items() if k != "loss_mask"}
    state = Generation(tensors=old, advantages=torch.zeros(2), old_logps=None, ref_logps=None, completion_tokens=4.0,
                       loss_tokens=4.0, completions=2.0, truncated=0.0, reward_stats={}, lag=0).state_dict(1)
    restored = Generation.from_state(state, torch.device("cpu"))
    assert torch.equal(restored.tensors["loss_mask"], tensors["completion_mask"])
    assert torch.equal(restored.tensors["loss_mask"], tensors["loss_mask"])


def test_the_generations_ahead_of_a_checkpoint_are_asked_for_again_by_their_prompts_older_checkpoints_too():
    """hpcrl.compute.train.ahead: a checkpoint keeps the prompts of the generations ahead; a resume
    asks for them again, oldest first, before the sampler's next. Checkpoints written before issue
    #31's drop kept the completions ("ahead", or one "next"): only their prompts are used now."""
    from types import SimpleNamespace

    from hpcrl.compute.train.ahead import Ahead

    asked = []

    def request(step, batch=None):
        asked.append((step, batch))
        return SimpleNamespace(batch=batch or f"sampled for {step}")

    ahead = Ahead(2, request)
    ahead.fill(0, 1, 10)
    assert ahead.state_dict()["ahead_prompts"] == ["sampled for 0", "sampled for 1"]
    assert "ahead" not in ahead.state_dict(), "no completions in a checkpoint"
    for extra, kept in [({"ahead_prompts": ["p3", "p4"]}, ["p3", "p4"]),
                        ({"ahead": [{"batch": "p3", "version": 2, "completions": ["c"]},
                                    {"batch": "p4", "version": 2, "completions": ["c"]}]}, ["p3", "p4"]),
                        ({"next": {"batch": "p3", "version": 2, "completions": ["c"]}}, ["p3"])]:
        resumed, asked[:] = Ahead(2, request), []
        assert resumed.load_state_dict({**extra, "pushed": [1, 2]}) == len(kept)
        assert len(resumed) == 0 and resumed.pushed == [1, 2]
        resumed.fill(3, 1, 10)
        resumed.queue.popleft()
        resumed.fill(4, 1, 10)
        assert asked == [(3, "p3"), (4, kept[1] if len(kept) > 1 else None), (5, None)], asked
