"""TRL GRPOConfig fields that hpcrl once could not take (issue 12), each wired from the recipe to
what it changes: the loss (importance_sampling_level, delta, off_policy_mask_threshold,
use_bias_correction_kl, sapo_*, vespo_*, entropy_coef), the advantages (multi_objective_aggregation),
sampling (min_p, repetition_penalty, generation_kwargs), prompt rendering (chat_template_kwargs), the
optimizer and schedule (optim, lr_scheduler_kwargs), dropout (disable_dropout), NEFTune (neftune_noise_alpha)
and the reference model (sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps). Each test fails if its
field is ignored.

The trainer's part runs the real `Trainer` on 2 gloo ranks (tests/dist_harness.py) with a generator
that returns fixed completions, as tests/compute/train/test_fields_wired.py does."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from dist_harness import spawn
from support import FixedGenerator, cpu_trainer_setup

from hpcrl.compute.inference.types import Sampling
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import GRPOConfig, ModelConfig, Recipe
from hpcrl.login import trl_config


# ------------------------------------------------------------------ the recipe
NEW_FIELDS = {
    "importance_sampling_level": "sequence", "delta": 1.5, "off_policy_mask_threshold": 0.5,
    "use_bias_correction_kl": False, "multi_objective_aggregation": "normalize_then_sum",
    "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 3.0, "vespo_k_pos": 1.0, "vespo_lambda_pos": 1.0,
    "vespo_k_neg": 1.0, "vespo_lambda_neg": 1.0, "entropy_coef": 0.01, "min_p": 0.1, "repetition_penalty": 1.1,
    "generation_kwargs": {"stop": ["\n"]}, "chat_template_kwargs": {"enable_thinking": False},
    "lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 1.0}, "optim": "adamw_torch",
    "disable_dropout": True, "beta": 0.04, "sync_ref_model": True, "ref_model_mixup_alpha": 0.9,
    "ref_model_sync_steps": 64, "neftune_noise_alpha": 5.0,
}


def test_a_trl_config_sets_each_field_under_its_own_name():
    t = trl_config.translate({"model_name_or_path": "m", "dataset_name": "d", **NEW_FIELDS})
    assert not t.problems, t.problems
    assert t.recipe["grpo"] == NEW_FIELDS and all(t.moved[k] == f"grpo.{k}" for k in NEW_FIELDS)
    GRPOConfig(**NEW_FIELDS).validate("grpo")


@pytest.mark.parametrize("fields, message", [
    ({"optim": "sgd"}, "grpo.optim: 'sgd' is not supported; hpcrl's optimizer is AdamW: one of adamw_torch, "
                       "adamw_torch_fused"),
    ({"lr_scheduler_kwargs": {"num_cycles": 2}}, "grpo.lr_scheduler_kwargs: num_cycles not taken by "
                                                 "lr_scheduler_type 'linear' (takes none)"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"power": 2}}, "takes only num_cycles"),
    ({"min_p": 1.5}, "grpo.min_p: must be in [0, 1] or null"),
    ({"repetition_penalty": 0}, "grpo.repetition_penalty: must be > 0"),
    ({"delta": 0}, "grpo.delta: must be > 0 or null"),
    ({"off_policy_mask_threshold": -1}, "grpo.off_policy_mask_threshold: must be >= 0"),
    ({"sapo_temperature_neg": 0}, "grpo.sapo_temperature_neg: must be > 0"),
    ({"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 0}, "grpo.ref_model_mixup_alpha: must be in (0, 1]"),
    ({"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 0}, "grpo.ref_model_sync_steps: must be at least 1"),
    ({"sync_ref_model": True}, "grpo.sync_ref_model: needs beta > 0"),
    ({"neftune_noise_alpha": -1.0}, "grpo.neftune_noise_alpha: must be >= 0 or null"),
])
def test_bad_values_are_refused_in_one_line(fields, message):
    with pytest.raises(UserError) as e:
        GRPOConfig(**fields).validate("grpo")
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ optim, lr_scheduler_kwargs
def test_optim_picks_the_adamw_kernel():
    from hpcrl.compute.train.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    fused = build_optimizer(model, GRPOConfig(optim="adamw_torch_fused"))
    plain = build_optimizer(model, GRPOConfig(optim="adamw_torch"))
    assert fused.defaults["fused"] is True       # the CPU has torch's fused AdamW
    assert not plain.defaults["fused"] and not plain.defaults["foreach"]      # torch's own choice
    with pytest.raises(ValueError, match="adamw_torch, adamw_torch_fused"):
        build_optimizer(model, GRPOConfig(optim="adafactor"))


def test_lr_scheduler_kwargs_reach_transformers_schedule():
    from transformers import get_cosine_schedule_with_warmup

    from hpcrl.compute.train.optim import build_scheduler

    def lrs(grpo, make=None):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=grpo.learning_rate)
        sched = make(opt) if make else build_scheduler(opt, grpo)
        out = []
        for _ in range(grpo.max_steps):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    base = GRPOConfig(learning_rate=1.0, max_steps=10, lr_scheduler_type="cosine", warmup_steps=2)
    two = dataclasses.replace(base, lr_scheduler_kwargs={"num_cycles": 2.0})
    expected = lrs(two, lambda opt: get_cosine_schedule_with_warmup(opt, 2, 10, num_cycles=2.0))
    assert lrs(two) == pytest.approx(expected)
    assert lrs(two) != pytest.approx(lrs(base))


# ------------------------------------------------------------------ min_p, repetition_penalty, generation_kwargs
def test_vllm_sampling_params_carry_the_fields_and_generation_kwargs_last():
    from hpcrl.compute.inference.vllm_engine import sampling_params

    s = Sampling(n=2, max_tokens=8, top_k=0, seed=3, min_p=0.2, repetition_penalty=1.3,
                 generation_kwargs={"max_tokens": 4, "stop": ["\n"]})
    p = sampling_params(s)
    assert (p["min_p"], p["repetition_penalty"], p["max_tokens"], p["stop"], p["top_k"]) == (0.2, 1.3, 4, ["\n"], -1)
    assert sampling_params(Sampling(n=1, max_tokens=8))["min_p"] == 0.0       # TRL's None


@pytest.fixture(scope="module")
def engine(model_dir):
    from hpcrl.compute.inference.hf_engine import TransformersEngine

    return TransformersEngine(model_dir)


PROMPTS = [[25, 13, 25, 31], [26, 13, 27, 31]]


def _tokens(engine, **kw) -> list[tuple[int, ...]]:
    return [c.token_ids for c in engine.generate(PROMPTS, Sampling(**{"n": 1, "max_tokens": 12, "seed": 1, **kw}))]


def test_transformers_engine_takes_min_p_repetition_penalty_and_generation_kwargs(engine):
    greedy = _tokens(engine, temperature=0)
    # min_p = 1 keeps only the most likely token: sampling becomes greedy.
    assert _tokens(engine, temperature=1.0, min_p=1.0) == greedy
    assert _tokens(engine, temperature=1.0) != greedy
    assert any(len(set(t)) < len(t) for t in greedy)        # the tiny model repeats itself...
    penalised = _tokens(engine, temperature=0, repetition_penalty=1e9)
    for prompt, t in zip(PROMPTS, penalised):               # ...and a huge penalty forbids it
        assert len(set(t)) == len(t) and not set(t) & set(prompt)
    # generation_kwargs go last, over hpcrl's own settings.
    assert {len(t) for t in _tokens(engine, temperature=0, generation_kwargs={"max_new_tokens": 3})} == {3}


# ------------------------------------------------------------------ the trainer
def _local_copy(model) -> list[torch.Tensor]:
    return [p.to_local().detach().float().clone() for p in model.parameters()]


def _w_trainer(rank, world, model_dir, run_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train import data as data_mod
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.sources import load_dataset, load_tokenizer
    from hpcrl.compute.train.entropy_control import EntropyControl
    from hpcrl.compute.train.loss import LossConfig
    from hpcrl.compute.train.trainer import Trainer

    ckpt.control_group(60)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    base = GRPOConfig(learning_rate=1e-2, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      beta=0.04, max_steps=4, seed=0, vllm_importance_sampling_correction=False,
                      gradient_checkpointing=False)
    recipe = Recipe(grpo=base, model=ModelConfig(attn_implementation="eager"))
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    tokenizer = load_tokenizer(recipe.model, model_dir)

    def trainer(dataset=None, **fields) -> tuple[Trainer, FixedGenerator]:
        r = dataclasses.replace(recipe, grpo=dataclasses.replace(base, **fields))
        setup = cpu_trainer_setup(r, run_dir, model_dir, policy, reference, rank=rank, world=world, tokenizer=tokenizer,
                                  dataset=dataset if dataset is not None else load_dataset(r.data, 0))
        gen = FixedGenerator(policy.config.vocab_size)
        return Trainer(setup, gen), gen

    # disable_dropout: every dropout module of policy and reference (the tiny model has none of its own).
    for model in (policy, reference):
        model.add_module("test_dropout", torch.nn.Dropout(0.3))
    trainer()
    assert policy.test_dropout.p == reference.test_dropout.p == 0.3
    trainer(disable_dropout=True)
    assert policy.test_dropout.p == reference.test_dropout.p == 0

    # neftune_noise_alpha: transformers' NEFTune hook on the policy's input embeddings, in training
    # forwards only, within +-alpha / sqrt(L x d); never on the reference; a trainer without it
    # removes the hook (a second one replaces it).
    ids = torch.tensor([[25, 13, 25, 31, 26, 13]])
    seen = []

    def forward(model):
        capture = model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.detach()))
        try:
            with torch.no_grad():
                return model(input_ids=ids).logits
        finally:
            capture.remove()

    clean, ref_clean = forward(policy), forward(reference)
    trainer(neftune_noise_alpha=5.0)
    trainer(neftune_noise_alpha=5.0)
    noisy = forward(policy)
    noise = (seen[-1] - seen[0]).abs()
    assert 0 < noise.max() <= 5.0 / math.sqrt(ids.shape[1] * seen[0].shape[-1]) + 1e-6
    assert noise.mean() > 0.3 * 5.0 / math.sqrt(ids.shape[1] * seen[0].shape[-1])    # uniform: its mean is half the bound
    assert not torch.equal(noisy, clean) and torch.equal(forward(reference), ref_clean)
    policy.eval()
    assert torch.equal(forward(policy), clean)
    policy.train()
    trainer()
    assert torch.equal(forward(policy), clean)

    # min_p, repetition_penalty, generation_kwargs: in the Sampling the trainer asks for.
    t, gen = trainer(min_p=0.05, repetition_penalty=1.2, generation_kwargs={"stop": ["\n"]})
    t._request(0)
    s = gen.asked[-1][1]
    assert (s.min_p, s.repetition_penalty, dict(s.generation_kwargs)) == (0.05, 1.2, {"stop": ["\n"]})

    # chat_template_kwargs: variables of the chat template when conversational prompts are rendered.
    tokenizer.chat_template = ("{%- for m in messages %}{{ prefix | default('') }}{{ m['content'] }}{%- endfor %}"
                               "{%- if add_generation_prompt %}={%- endif %}")
    chat = data_mod.demo_dataset(64, seed=0, conversational=True)
    lengths = []
    for kwargs in (None, {"prefix": "1+1+"}):
        t, gen = trainer(dataset=chat, chat_template_kwargs=kwargs)
        batch = t._request(0).batch
        lengths.append([len(p) for p in batch.prompt_ids])
        assert all(text.startswith("1+1+") for text in batch.texts) == (kwargs is not None)
    assert [b - a for a, b in zip(*lengths)] == [4] * len(lengths[0])

    # multi_objective_aggregation: the advantages of the same completions.
    t, gen = trainer()
    requested = t._request(0)
    batch, completions = requested.batch.repeat(base.num_generations), requested.take()
    summed, _ = t.scorer.score(batch, completions, t.step)
    t.scorer.recipe = dataclasses.replace(t.recipe, grpo=dataclasses.replace(
        base, multi_objective_aggregation="normalize_then_sum"))
    normalized, _ = t.scorer.score(batch, completions, t.step)
    assert not torch.allclose(summed, normalized)

    # The loss fields: one optimizer step's loss on one generation, off-policy (old, sampling and
    # reference log-probabilities each moved by noise), the weights left as they are.
    t, gen = trainer()
    generation = t._next_generation()
    t.setup.policy.eval()
    with torch.no_grad():
        logps = t._micro_batched_logps(policy, generation.tensors)
    noise = torch.Generator().manual_seed(rank)
    old = logps + (torch.rand(logps.shape, generator=noise) * 2 - 1)
    tensors = dict(generation.tensors, sampling_logps=logps + (torch.rand(logps.shape, generator=noise) * 2 - 1))
    ref = logps + (torch.rand(logps.shape, generator=noise) * 2 - 1)      # (policy = reference so far)
    generation = dataclasses.replace(generation, old_logps=old, ref_logps=ref, tensors=tensors)
    t.optimizer.step = lambda: None

    def loss(**fields) -> float:
        t.grpo = dataclasses.replace(t.grpo, **{**{f.name: getattr(base, f.name) for f in
                                                   dataclasses.fields(GRPOConfig)}, "max_steps": t.grpo.max_steps,
                                                **fields})
        t.loss_config = LossConfig.from_grpo(t.grpo, world)       # built once for a run: here for each setting
        t.entropy = EntropyControl(t.grpo)
        return t._optimizer_step(generation)["loss"]

    plain = loss()
    assert loss() == plain          # nothing moves between calls
    for fields in ({"importance_sampling_level": "sequence"}, {"delta": 1.05}, {"off_policy_mask_threshold": 0.0},
                   {"use_bias_correction_kl": False}, {"entropy_coef": 0.5}, {"top_entropy_quantile": 0.3}):
        assert not math.isclose(loss(**fields), plain, rel_tol=1e-6), fields
    for loss_type, fields in (("sapo", {"sapo_temperature_pos": 3.0, "sapo_temperature_neg": 0.3}),
                              ("vespo", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 1.0,
                                         "vespo_lambda_neg": 0.5})):
        assert not math.isclose(loss(loss_type=loss_type, **fields), loss(loss_type=loss_type), rel_tol=1e-6), fields
    del t.optimizer.step

    # sync_ref_model: every ref_model_sync_steps optimizer steps, reference = a * policy + (1 - a) * reference,
    # shard by shard; the training checkpoint keeps the moved reference.
    t, gen = trainer(sync_ref_model=True, ref_model_mixup_alpha=0.25, ref_model_sync_steps=2)
    generation = t._next_generation()
    before = _local_copy(reference)
    t._optimizer_step(generation)           # step 1: not due
    t.step = 1
    assert all(torch.equal(a, b) for a, b in zip(before, _local_copy(reference)))
    t._optimizer_step(generation)           # step 2: due
    after, pol = _local_copy(reference), _local_copy(policy)
    for r0, r1, p in zip(before, after, pol):
        torch.testing.assert_close(r1, 0.25 * p + 0.75 * r0, rtol=1e-2, atol=1e-2)     # (bf16 or fp32 shards)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    shards = t._reference_shards()
    with torch.no_grad():
        for p in reference.parameters():
            p.to_local().zero_()
    t._load_reference_shards(shards)
    assert all(torch.equal(a, b) for a, b in zip(after, _local_copy(reference)))
    assert trainer()[0]._reference_shards() is None         # nothing kept without sync_ref_model


def test_trainer_wires_the_fields(model_dir, tmp_path):
    spawn(_w_trainer, tmp_path, model_dir, str(tmp_path / "run"), timeout=300)


def test_top_entropy_quantile_masks_as_trl():
    """grpo.top_entropy_quantile: the mask equals TRL's get_high_entropy_mask (one process), and
    only the masked tokens carry policy gradient."""
    from trl import GRPOTrainer

    from hpcrl.compute.train.loss import LossConfig, grpo_loss, high_entropy_mask

    torch.manual_seed(0)
    entropies = torch.rand(4, 6)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    accelerator = SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t, gather=lambda t: t)
    for q in (0.2, 0.5, 0.9):
        theirs = GRPOTrainer.get_high_entropy_mask(SimpleNamespace(accelerator=accelerator), entropies, mask, 1 - q)
        ours = high_entropy_mask(entropies, mask, 1 - q)
        assert torch.equal(ours, theirs), q
    keep = high_entropy_mask(entropies, mask, 0.5)
    logps = torch.full((4, 6), -1.0, requires_grad=True)
    loss, _ = grpo_loss(logps, None, None, torch.tensor([1.0, -1.0, 0.5, 2.0]), mask, LossConfig(), entropy_mask=keep)
    loss.backward()
    assert torch.equal(logps.grad != 0, keep)
