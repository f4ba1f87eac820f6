"""TRL's value space and the defaults TRL derives from the model (issue #25): what a `trl grpo
--config` YAML may hold is taken as TRL takes it, or refused in one line naming the key the user wrote."""

from __future__ import annotations

import inspect
import json
import shutil
import sys
from pathlib import Path

import pytest

from hpcrl.job import context
from hpcrl.job.errors import UserError
from hpcrl.job.grpo_config import SCHEDULER_KWARGS, SCHEDULER_REQUIRED, SCHEDULERS_ON_METRICS
from hpcrl.login import compose


def _recipe(tmp_path: Path, text: str, *overrides: str):
    (tmp_path / "cfg.yaml").write_text("model_name_or_path: demo:tiny\ndataset_name: demo\n" + text)
    return compose.build_recipe(str(tmp_path / "cfg.yaml"), list(overrides))


def _refusal(tmp_path: Path, text: str, *overrides: str) -> str:
    """`hpcrl plan` of the configuration, as a user runs it: its one line (exit 2, no traceback)."""
    from conftest import run_hpcrl

    (tmp_path / "cfg.yaml").write_text("model_name_or_path: demo:tiny\ndataset_name: demo\n" + text)
    proc = run_hpcrl("plan", "--site", "local", "cfg.yaml", *overrides, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().removeprefix("hpcrl: error: ")


# ---------------------------------------------------------------------------- values TRL takes
def test_a_trl_config_saves_the_model_in_trls_default_dtype(tmp_path):
    """TRL's CLI loads the model in float32 unless dtype says otherwise, and saves it so: a bf16
    checkpoint's run writes float32 directories (updates bf16 would round away are kept)."""
    from hpcrl.compute.train.export import saved_dtype

    import torch

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    trl = _recipe(tmp_path, "").recipe
    assert (trl.model.dtype, trl.checkpoint.model_dtype) == ("auto", "float32")
    assert saved_dtype(trl, model) == torch.float32
    for text in ("dtype: bfloat16\n", "model_init_kwargs: {torch_dtype: bfloat16}\n"):
        r = _recipe(tmp_path, text).recipe
        assert (r.model.dtype, r.checkpoint.model_dtype) == ("bfloat16", "auto") and saved_dtype(r, model) == torch.bfloat16
    auto = _recipe(tmp_path, "dtype: auto\n").recipe
    assert saved_dtype(auto, model) == torch.bfloat16                 # TRL's "auto": the checkpoint's
    own = compose.build_recipe(None, [f"model.path={model}"]).recipe  # hpcrl's own recipe: the checkpoint's
    assert own.checkpoint.model_dtype == "auto" and saved_dtype(own, model) == torch.bfloat16


def test_trls_legacy_importance_sampling_cap_is_its_clip_max(tmp_path):
    assert _recipe(tmp_path, "vllm_importance_sampling_cap: 2.5\n").recipe.grpo.vllm_importance_sampling_clip_max == 2.5


@pytest.mark.parametrize("value, mode", [("true", "group"), ("false", "none"), ("batch", "batch")])
def test_scale_rewards_takes_trls_booleans(tmp_path, value, mode):
    assert _recipe(tmp_path, f"scale_rewards: {value}\n").recipe.grpo.scale_rewards == mode
    assert _recipe(tmp_path, "", f"grpo.scale_rewards={value}").recipe.grpo.scale_rewards == mode


def test_every_transformers_scheduler_is_taken_or_named():
    from transformers import SchedulerType
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION

    assert set(SCHEDULER_KWARGS) | set(SCHEDULERS_ON_METRICS) == {s.value for s in SchedulerType}
    for name, kwargs in SCHEDULER_KWARGS.items():
        takes = set(inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters)
        assert set(kwargs) <= takes, name
        assert set(SCHEDULER_REQUIRED.get(name, ())) <= set(kwargs)


@pytest.mark.parametrize("name, kwargs, final_lr", [
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 0.1),          # open-r1's recipes
    ("warmup_stable_decay", {"num_decay_steps": 2}, 0.0),
    ("cosine_with_restarts", {"num_cycles": 2}, 0.0),
    ("polynomial", {"lr_end": 0.25, "power": 2.0}, 0.25),
    ("inverse_sqrt", {}, None),
])
def test_schedulers_run_as_transformers_runs_them(tmp_path, name, kwargs, final_lr):
    import torch

    from hpcrl.compute.train.optim import build_scheduler

    grpo = _recipe(tmp_path, f"lr_scheduler_type: {name}\nlr_scheduler_kwargs: {json.dumps(kwargs)}\n"
                   "learning_rate: 1.0\nmax_steps: 10\nwarmup_steps: 2\n").recipe.grpo
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, grpo)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1.0)            # linear warmup, then the schedule
    if final_lr is not None:
        assert opt.param_groups[0]["lr"] == pytest.approx(final_lr, abs=1e-6)


@pytest.mark.parametrize("text, words", [
    ("lr_scheduler_type: cosine_with_min_lr\n", ["lr_scheduler_kwargs", "one of min_lr and min_lr_rate"]),
    ("lr_scheduler_type: warmup_stable_decay\n", ["lr_scheduler_kwargs", "needs num_decay_steps"]),
    ("lr_scheduler_type: reduce_lr_on_plateau\n", ["lr_scheduler_type (grpo.lr_scheduler_type)",
                                                   "evaluation metric"]),
    ("lr_scheduler_type: cosin\n", ["lr_scheduler_type", 'did you mean "cosine"']),
    ("lr_scheduler_type: cosine\nlr_scheduler_kwargs: {min_lr: 0.1}\n", ["min_lr not taken", "num_cycles"]),
    ("gradient_checkpointing_kwargs: {preserve_rng_state: false}\n", ["gradient_checkpointing_kwargs",
                                                                     "only use_reentrant"]),
    ("model_init_kwargs: {revision: main}\n", ["model_init_kwargs.revision", "dtype"]),
    ("vllm_max_model_length: 64\nmax_completion_length: 64\n", ["vllm_max_model_length (inference.max_model_len)",
                                                                 "no room for prompts"]),
])
def test_a_trl_value_hpcrl_cannot_run_is_one_line_naming_the_key(tmp_path, text, words):
    message = _refusal(tmp_path, text)
    assert "\n" not in message and all(w in message for w in words), message


def test_keys_that_change_nothing_hpcrl_trains_are_inert_with_their_reason(tmp_path):
    t = _recipe(tmp_path, "use_liger_kernel: true\ntorch_compile: true\nlog_unique_prompts: true\ndata_seed: 3\n"
                "gradient_checkpointing_kwargs: {use_reentrant: false}\nvllm_gpu_memory_utilization: 0.3\n"
                "model_init_kwargs: {device_map: auto}\n").trl
    for key in ("use_liger_kernel", "torch_compile", "log_unique_prompts", "data_seed",
                "gradient_checkpointing_kwargs", "vllm_gpu_memory_utilization", "model_init_kwargs.device_map"):
        assert t.inert[key] and t.inert[key] != "TRL's default", key
    # TRL's colocate share (its default mode) is not applied to an engine GPU of its own...
    assert "colocate" in t.inert["vllm_gpu_memory_utilization"]
    assert _recipe(tmp_path, "vllm_gpu_memory_utilization: 0.3\n").recipe.inference.gpu_memory_utilization == 0.85
    # ...a server-mode engine's share is.
    r = _recipe(tmp_path, "vllm_mode: server\nvllm_gpu_memory_utilization: 0.7\n").recipe
    assert r.inference.gpu_memory_utilization == 0.7


def test_model_init_kwargs_and_vllm_model_impl_reach_the_model_and_engine(tmp_path):
    r = _recipe(tmp_path, "model_init_kwargs: {torch_dtype: bfloat16, trust_remote_code: true, "
                "attn_implementation: eager}\nvllm_model_impl: transformers\n").recipe
    assert (r.model.dtype, r.model.trust_remote_code, r.model.attn_implementation) == ("bfloat16", True, "eager")
    assert r.inference.engine_args == {"model_impl": "transformers"}
    assert "model.dtype, which the recipe also sets" in _refusal(
        tmp_path, "dtype: float32\nmodel_init_kwargs: {dtype: bfloat16}\n")


def test_save_and_eval_strategy_epoch(tmp_path):
    from hpcrl.compute.train.evaluation import epoch_ended, eval_due

    g = _recipe(tmp_path, "save_strategy: epoch\neval_strategy: epoch\nmax_steps: 9\n").recipe.grpo
    assert (g.save_strategy, g.eval_strategy) == ("epoch", "epoch")
    # 3 steps a pass over the prompts, and one pass of 2.5 steps
    assert [s for s in range(1, 10) if epoch_ended(s, 1 / 3, 9)] == [3, 6, 9]
    assert [s for s in range(1, 10) if epoch_ended(s, 0.4, 9)] == [3, 5, 8, 9]
    assert [s for s in range(1, 10) if eval_due(g, s, 1 / 3)] == [3, 6, 9]


# ---------------------------------------------------------------------------- the engine's context
def _model(tmp_path: Path, positions: int, tokenizer_max: int | None = None, **cfg) -> Path:
    d = tmp_path / f"m{positions}-{tokenizer_max}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": positions, **cfg}))
    if tokenizer_max is not None:
        (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": tokenizer_max}))
    return d


def test_the_context_is_derived_from_the_model_as_vllm_derives_it(tmp_path):
    assert context.model_context(str(_model(tmp_path, 512))) == context.Context(
        512, "max_position_embeddings in config.json")
    assert context.model_context(str(_model(tmp_path, 4096, 2048))).tokens == 2048
    assert context.model_context(str(_model(tmp_path, 4096, 10**30))).tokens == 4096   # transformers' "unset"
    linear = _model(tmp_path, 2048, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert context.model_context(str(linear)).tokens == 8192
    yarn = _model(tmp_path, 32768, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert context.model_context(str(yarn)).tokens == 32768                 # already scaled
    assert context.from_configs({"model_type": "x"}).tokens == 2048
    assert context.model_context("demo:tiny") is None and context.model_context(str(tmp_path / "nowhere")) is None


def test_max_model_len_unset_is_the_models_context_and_set_is_checked_against_it(tmp_path):
    small = _model(tmp_path, 512)
    (tmp_path / "cfg.yaml").write_text(f"model_name_or_path: {small}\ndataset_name: demo\nmax_completion_length: 1024\n")
    r = compose.build_recipe(str(tmp_path / "cfg.yaml")).recipe
    assert r.inference.max_model_len is None
    compose._validate_context(r)        # TRL runs it (vLLM takes the model's 512): so does hpcrl
    (tmp_path / "cfg.yaml").write_text(f"model_name_or_path: {small}\ndataset_name: demo\nvllm_max_model_length: 1024\n")
    with pytest.raises(UserError) as e:
        compose._validate_context(compose.build_recipe(str(tmp_path / "cfg.yaml")).recipe)
    assert "over the model's context of 512 tokens (max_position_embeddings in config.json)" in str(e.value)


def test_the_estimate_sizes_the_engine_for_the_models_context_and_trainers_for_the_completions(tmp_path):
    from hpcrl.job import job_memory

    model = _model(tmp_path, 32768)
    spec = type("S", (), {})()
    spec.recipe = compose.build_recipe(None, [f"model.path={model}", "grpo.max_completion_length=512"]).recipe
    assert job_memory.engine_len(spec) == 32768
    assert job_memory.train_seq_len(spec) == 512 + job_memory.ASSUMED_PROMPT_TOKENS
    spec.recipe = compose.build_recipe(None, [f"model.path={model}", "inference.max_model_len=4096"]).recipe
    assert job_memory.engine_len(spec) == job_memory.train_seq_len(spec) == 4096


# ---------------------------------------------------------------------------- run names
@pytest.mark.parametrize("text, name", [
    ("run_name: my-run\noutput_dir: out/grpo-qwen\n", "my-run"),
    ("output_dir: out/grpo-qwen\n", "grpo-qwen"),
    ("", "cfg"),
])
def test_a_run_is_named_as_trl_names_it(tmp_path, text, name):
    assert _recipe(tmp_path, text).recipe.name == name


def test_the_demo_keeps_its_name():
    assert compose.build_recipe(None).recipe.name == "hpcrl-demo"


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_model_with_a_short_context_runs_on_vllm_and_says_when_the_context_cuts(tmp_path):
    """A model of 64 positions (vLLM refused the old 1024 default on the node) runs with its own
    context, and completions the context cuts before max_completion_length are named in a warning."""
    pytest.importorskip("vllm")
    from conftest import run_to_the_end

    from hpcrl.compute.models.tiny import make_tiny_model

    model = tmp_path / "short"
    shutil.copytree(make_tiny_model(tmp_path / "tiny", size="tiny", seed=0), model)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        cfg = json.loads((model / name).read_text())
        cfg[key] = 64
        (model / name).write_text(json.dumps(cfg))
    # ~30-token prompts: 60 completion tokens do not fit beside them in 64 positions
    rows = [{"prompt": f"What is {a} plus {b}? Answer: {a}+{b}=", "answer": str(a + b)} for a in range(4)
            for b in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def length(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    (tmp_path / "cfg.yaml").write_text(
        "model_name_or_path: short\ndataset_name: train.jsonl\nreward_funcs: [rewards.length]\n"
        "per_device_train_batch_size: 8\nnum_generations: 4\nmax_completion_length: 60\nmax_steps: 2\n"
        "learning_rate: 1.0e-4\nuse_vllm: true\nbeta: 0.0\ngradient_checkpointing: false\n")
    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", "cfg.yaml", "--run-dir", "run",
                           "inference.engine=vllm"], tmp_path, 400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "finished: step 2 of 2" in proc.stdout, out[-4000:]
    assert "completions were cut by the engine's context" in out and "vllm_max_model_length" in out, out[-4000:]
    assert json.loads((tmp_path / "run" / "job.json").read_text())["recipe"]["name"] == "cfg"
    report = json.loads((tmp_path / "run" / "model-vs-base.json").read_text())
    assert report["changed"] > 0 and "learned nothing" not in proc.stdout
