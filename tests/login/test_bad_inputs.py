"""Every user mistake: exit status 2, one line naming the field and what is allowed, no traceback,
no run directory or script left behind, nothing submitted to Slurm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

FRONTIER = ["--site", "frontier", "-A", "abc123"]
TESTBED = ["--site", "testbed"]

# (id, recipe file text or None, arguments after `hpcrl submit`, text the error must contain)
CASES = [
    ("yaml-syntax", "grpo: {beta: [1, 2\n", TESTBED, "invalid YAML at line"),
    ("yaml-not-mapping", "- a\n- b\n", TESTBED, "top level must be a mapping"),
    ("yaml-not-utf8", b"\xff\xfe\x00bad", TESTBED, "not a UTF-8"),
    ("recipe-missing", None, [*TESTBED, "nope.yaml"], "no such file"),
    ("site-unknown", None, ["--site", "frontir", "-A", "x"], 'did you mean "frontier"'),
    ("site-path", None, ["--site", "../etc/passwd"], "not a site name"),
    ("key-unknown-top", "gpro:\n  beta: 0.1\n", TESTBED, 'gpro: unknown field (did you mean "grpo"?)'),
    ("key-unknown-nested", None, [*TESTBED, "grpo.learning_rat=1e-5"], 'did you mean "learning_rate"'),
    ("nodes-zero", None, [*TESTBED, "-N", "0"], "nodes: must be at least 1"),
    ("nodes-negative", None, [*TESTBED, "-N", "-3"], "nodes: must be at least 1"),
    ("nodes-not-int", None, [*TESTBED, "-N", "two"], "invalid int value"),
    ("time-format", None, [*TESTBED, "-t", "1h"], "not a Slurm time"),
    ("time-minutes-60", None, [*TESTBED, "-t", "00:61:00"], "field out of range"),
    ("time-zero", None, [*TESTBED, "-t", "0"], "longer than zero"),
    ("time-over-bin", None, [*FRONTIER, "-N", "10", "-t", "03:00:00"], "over the 02:00:00 limit for 10 node(s)"),
    ("time-over-top-bin", None, [*FRONTIER, "-N", "200", "-t", "13:00:00"], "over the 12:00:00 limit"),
    ("debug-qos-hours", None, [*FRONTIER, "-N", "100", "-q", "debug", "-t", "03:00:00"], "QOS debug's limit of 02:00:00"),
    ("account-missing", None, ["--site", "frontier"], "requires a project account"),
    ("partition-unknown", None, [*FRONTIER, "-p", "batchh"], 'did you mean "batch"'),
    ("extended-nodes", None, [*FRONTIER, "-p", "extended", "-N", "65"], "over partition extended's limit of 64"),
    ("server-gpus-all", None, [*FRONTIER, "inference.gpus=8"], "inference.gpus: 8 server GPU(s) leave no trainer"),
    ("server-gpus-testbed", None, [*TESTBED, "inference.gpus=4"], "allowed: 1..3"),
    ("loss-type", None, [*TESTBED, "grpo.loss_type=grpoo"], 'grpo.loss_type: \'grpoo\' is not one of'),
    ("beta-negative", None, [*TESTBED, "grpo.beta=-0.1"], "grpo.beta: must be >= 0"),
    ("is-mode", None, [*TESTBED, "grpo.vllm_importance_sampling_mode=sequence"], "grpo.vllm_importance_sampling_mode"),
    ("staleness-negative", None, [*TESTBED, "inference.max_staleness=-1"], "inference.max_staleness: must be >= 0"),
    ("in-flight-synchronous", None, [*TESTBED, "inference.weight_update=in_flight"],
     "inference.weight_update: in_flight lands syncs in generations under way; it needs inference.max_staleness >= 1"),
    ("weight-update-word", None, [*TESTBED, "inference.max_staleness=2", "inference.weight_update=inflight"],
     'got \'inflight\' (did you mean "in_flight"?)'),
    ("is-truncate-unbounded", None, [*TESTBED, "grpo.vllm_importance_sampling_mode=token_truncate",
                                     "grpo.vllm_importance_sampling_clip_max=null"], "needs vllm_importance_sampling_clip_min"),
    ("is-bounds-crossed", None, [*TESTBED, "grpo.vllm_importance_sampling_clip_min=4"], "must be below clip_max (3.0)"),
    ("generations-divide", None, [*TESTBED, "grpo.num_generations=3"], "grpo.num_generations: 3 does not divide"),
    ("lr-not-number", None, [*TESTBED, "grpo.learning_rate=fast"], "grpo.learning_rate: expected a number"),
    ("reward-path", "rewards:\n  - func: 'not a path!'\n", TESTBED, "rewards[0].func"),
    ("reward-missing-module", "rewards:\n  - func: no_such_pkg.rewards:f\n", TESTBED,
     "rewards[0].func: no module named 'no_such_pkg'"),
    ("reward-weight", "rewards:\n  - func: a.b:c\n    weight: heavy\n", TESTBED, "rewards[0].weight: expected a number"),
    ("reward-trl-name", "rewards: [think_format_reward, acuracy_reward]\n", TESTBED,
     'rewards[1].func: \'acuracy_reward\' is neither an import path like "my_rewards:function" nor one of '
     'TRL\'s reward functions (did you mean "accuracy_reward"?)'),
    ("reward-module-nowhere", "rewards: ['my_rewards:correct']\n", TESTBED,
     "rewards[0].func: no module named 'my_rewards' in "),
    ("reward-kwargs", "rewards:\n  - func: get_soft_overlong_punishment\n    kwargs: 1280\n", TESTBED,
     "rewards[0].kwargs: expected a mapping"),
    ("reward-kwargs-typo", "rewards:\n  - func: get_soft_overlong_punishment\n    kwarg: {}\n", TESTBED,
     'rewards[0].kwarg: unknown field (did you mean "kwargs"?)'),
    ("mode-unknown", None, [*TESTBED, "mode=probee"], 'mode: expected one of'),
    ("gpu-mem-util", None, [*TESTBED, "inference.gpu_memory_utilization=1.5"], "must be in (0, 1]"),
    ("keep-zero", None, [*TESTBED, "checkpoint.keep=0"], "checkpoint.keep: must be at least 1"),
    ("model-load-timeout", None, [*TESTBED, "launch.model_load_timeout_s=0"], "launch.model_load_timeout_s: must be > 0"),
    ("generation-rate", None, [*TESTBED, "inference.generation_s_per_ktoken=-2"],
     "inference.generation_s_per_ktoken: must be > 0"),
    ("override-no-equals", None, [*TESTBED, "a.yaml", "grpo.beta"], "expected key=value"),
    ("override-bad-key", None, [*TESTBED, "grpo..beta=1"], "expected key.path=value"),
    ("site-setup-override", None, [*TESTBED, "site.setup=[id]"], "site.setup: shell set-up lines"),
    ("site-env-name", "site:\n  env: {'A-B': 1}\n", TESTBED, "not a valid environment variable name"),
    ("unknown-flag", None, [*TESTBED, "--nodez", "2"], "unrecognized arguments"),
    ("output-dir-missing", None, [*TESTBED, "-o", "/nonexistent/dir/job.sh"], "--output: directory"),
    ("local-site-submit", None, ["--site", "local"], "has no Slurm"),
    # Frontier's compute nodes cannot write User/Project Home.
    ("run-dir-readonly", None, [*FRONTIER, "--run-dir", "/ccs/home/someone/runs/x"],
     "--run-dir: /ccs/home/someone/runs/x is under /ccs/home, which frontier's compute nodes cannot write"),
    ("checkpoint-dir-readonly", None, [*FRONTIER, "checkpoint.dir=/ccs/proj/abc123/ckpt"],
     "checkpoint.dir: /ccs/proj/abc123/ckpt is under /ccs/proj"),
    # Injection attempts in every user-controlled field that lands on an #SBATCH line.
    ("inject-name-subshell", None, [*TESTBED, "-J", "x$(touch /tmp/hpcrl-pwned)"], "name:"),
    ("inject-name-backtick", None, [*TESTBED, "-J", "x`touch /tmp/hpcrl-pwned`"], "name:"),
    ("inject-name-newline", None, [*TESTBED, "-J", "x\ntouch /tmp/hpcrl-pwned"], "name:"),
    ("inject-name-quote", None, [*TESTBED, "-J", "x'\"y"], "name:"),
    ("inject-account", None, [*TESTBED, "-A", "a;touch /tmp/hpcrl-pwned"], "account:"),
    ("inject-partition", None, [*TESTBED, "-p", "debug$(id)"], "partition:"),
    ("inject-qos", None, [*TESTBED, "-q", "normal\n#SBATCH --wrap=id"], "qos:"),
    ("inject-run-dir-newline", None, [*TESTBED, "--run-dir", "r\ntouch /tmp/hpcrl-pwned"], "--run-dir: control characters"),
    ("inject-run-dir-quote", None, [*TESTBED, "--run-dir", 'r"$(id)"'], "--run-dir:"),
    ("inject-sbatch-option", "resources:\n  sbatch_options: ['--comment=a\n\nid']\n", TESTBED, "resources.sbatch_options"),
    ("inject-sbatch-option-space", "resources:\n  sbatch_options: ['--comment=a b']\n", TESTBED, "resources.sbatch_options"),
    ("inject-srun-option", "resources:\n  srun_options: ['$(id)']\n", TESTBED, "resources.srun_options"),
    ("inject-site-partition", None, [*TESTBED, "site.partition=x$(id)"], "partition/qos"),
    # TRL configurations (`trl grpo --config` YAML)
    ("trl-bnb-8bit-adamw", "model_name_or_path: m\ndataset_name: d\noptim: paged_adamw_8bit\n", TESTBED,
     "optim (grpo.optim): 'paged_adamw_8bit' is bitsandbytes' 8-bit AdamW, whose kernels do not take FSDP2's "
     "sharded parameters; adamw_torch_8bit keeps the Adam moments in 8 bits too"),
    ("8bit-adamw-deepspeed", None, [*TESTBED, "grpo.optim=adamw_torch_8bit", "trainer.engine=deepspeed"],
     "grpo.optim: adamw_torch_8bit with trainer.engine=fsdp2 only in this version"),
    ("trl-not-implemented", "model_name_or_path: m\ndataset_name: d\nuse_peft: true\nload_in_4bit: true\n",
     TESTBED, "load_in_4bit: quantized training is not supported"),
    ("trl-target-parameters-dropout", "model_name_or_path: m\ndataset_name: d\nuse_peft: true\n"
     "lora_target_parameters: [mlp.experts.gate_up_proj]\n", TESTBED,
     "model.lora_dropout: 0.05: peft's adapters on parameters"),
    ("modules-to-save-tied", None, [*TESTBED, "model.use_peft=true", "model.lora_modules_to_save=[lm_head]"],
     "model.lora_modules_to_save: lm_head: the head is tied to the input embeddings in this model"),
    ("trl-dora-without-peft", None, [*TESTBED, "model.use_dora=true"],
     "model.use_dora: a LoRA setting: set model.use_peft too"),
    ("modules-to-save-unknown", None, [*TESTBED, "model.use_peft=true", "model.lora_modules_to_save=[norm]"],
     "model.lora_modules_to_save: 'norm': lm_head and embed_tokens only in this version"),
    ("trl-no-dataset", "model_name_or_path: m\nlearning_rate: 1.0e-5\n", TESTBED, "dataset_name: required"),
    ("trl-set-twice", "model_name_or_path: m\ndataset_name: d\nbeta: 0.1\ngrpo: {beta: 0.2}\n", TESTBED,
     "beta: sets grpo.beta, which the recipe also sets"),
    ("trl-reward-weights", "model_name_or_path: m\ndataset_name: d\nreward_funcs: [a.b]\nreward_weights: [1, 2]\n",
     TESTBED, "reward_weights: expected one weight per reward function (1)"),
    ("trl-report-to", "model_name_or_path: m\ndataset_name: d\nreport_to: mlflow\n", TESTBED, "report_to: 'mlflow'"),
    ("trl-unknown", "model_name_or_path: m\ndataset_name: d\nlearnin_rate: 1\n", TESTBED,
     'learnin_rate: unknown field (did you mean "learning_rate"?)'),
    ("max-steps-zero", None, [*TESTBED, "grpo.max_steps=0"], "grpo.max_steps: must be > 0, or -1"),
    ("warmup-steps", None, [*TESTBED, "grpo.warmup_steps=2.5"], "grpo.warmup_steps: must be a whole number"),
    ("optim", None, [*TESTBED, "grpo.optim=sgd"],
     "grpo.optim: 'sgd' is not supported; hpcrl's optimizer is AdamW: one of adamw_torch, adamw_torch_fused"),
    ("trl-optim", "model_name_or_path: demo:tiny\ndataset_name: demo\noptim: adafactor\n", TESTBED,
     "optim (grpo.optim): 'adafactor' is not supported"),
    ("lr-scheduler-kwargs", None, [*TESTBED, "grpo.lr_scheduler_type=cosine", "grpo.lr_scheduler_kwargs={power: 2}"],
     "grpo.lr_scheduler_kwargs: power not taken by lr_scheduler_type 'cosine' (takes only num_cycles)"),
    ("importance-sampling-level", None, [*TESTBED, "grpo.importance_sampling_level=seq"],
     "grpo.importance_sampling_level: expected one of 'token', 'sequence'"),
    ("multi-objective-aggregation", None, [*TESTBED, "grpo.multi_objective_aggregation=sum"],
     "grpo.multi_objective_aggregation: expected one of"),
    ("min-p", None, [*TESTBED, "grpo.min_p=2"], "grpo.min_p: must be in [0, 1] or null"),
    ("repetition-penalty", None, [*TESTBED, "grpo.repetition_penalty=0"], "grpo.repetition_penalty: must be > 0"),
    ("generation-kwargs", None, [*TESTBED, "grpo.generation_kwargs=3"], "grpo.generation_kwargs: expected a mapping"),
    ("sync-ref-model-no-beta", None, [*TESTBED, "grpo.sync_ref_model=true"], "grpo.sync_ref_model: needs beta > 0"),
    ("ref-model-mixup-alpha", None, [*TESTBED, "grpo.beta=0.1", "grpo.sync_ref_model=true",
                                     "grpo.ref_model_mixup_alpha=1.5"], "grpo.ref_model_mixup_alpha: must be in (0, 1]"),
    ("output-dir-not-model", "checkpoint:\n  output_dir: /etc\n", TESTBED,
     "checkpoint.output_dir (TRL's output_dir): /etc holds files that are not a model"),
    # LoRA (model.use_peft)
    ("lora-rank", None, [*TESTBED, "model.use_peft=true", "model.lora_r=0"], "model.lora_r: the adapters' rank"),
    ("lora-sync-ref-model", None, [*TESTBED, "model.use_peft=true", "grpo.beta=0.1", "grpo.sync_ref_model=true"],
     "grpo.sync_ref_model: not with model.use_peft"),
    ("lora-target-typo", None, [*TESTBED, "model.use_peft=true", "model.lora_target_modules=[q_proj,v_prj]"],
     "model.lora_target_modules: 'v_prj' matches no module of demo:tiny (did you mean \"v_proj\"?); its linear "
     "layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ("lora-target-regex", None, [*TESTBED, "model.use_peft=true", "model.lora_target_modules=.*attn\\.qproj"],
     'model.lora_target_modules: the regular expression ".*attn\\.qproj" matches no module path of demo:tiny'),
    # DeepSpeed ZeRO-3 (trainer.engine=deepspeed; a user's JSON file in FILE_CASES below)
    ("deepspeed-offload-fsdp2", None, [*TESTBED, "trainer.offload_optimizer=true"],
     "trainer.offload_optimizer: ZeRO-3 offload to host memory, only with trainer.engine=deepspeed"),
    ("deepspeed-config-without-engine", None, [*TESTBED, "trainer.deepspeed_config={zero_optimization: {stage: 3}}"],
     "trainer.deepspeed_config: a DeepSpeed configuration, read only with trainer.engine=deepspeed; set "
     "trainer.engine=deepspeed"),
    ("deepspeed-lora", None, [*TESTBED, "trainer.engine=deepspeed", "model.use_peft=true"],
     "trainer.engine=deepspeed: LoRA (model.use_peft) trains with trainer.engine=fsdp2 only in this version"),
    ("deepspeed-stage", None, [*TESTBED, "trainer.engine=deepspeed", "trainer.deepspeed_config={zero_optimization: {stage: 2}}"],
     "trainer.deepspeed_config: zero_optimization.stage 2: trainer.engine=deepspeed runs ZeRO stage 3"),
    ("deepspeed-json-missing", None, [*TESTBED, "trainer.engine=deepspeed", "trainer.deepspeed_config=no-such.json"],
     "trainer.deepspeed_config: no such file no-such.json"),
    ("deepspeed-engine", None, [*TESTBED, "trainer.engine=zero3"], "trainer.engine: expected one of 'fsdp2', 'deepspeed'"),
    ("trl-deepspeed-fp16", "model_name_or_path: demo:tiny\ndataset_name: demo\ndeepspeed: {fp16: {enabled: true}}\n",
     TESTBED, "trainer.deepspeed_config: fp16.enabled true: hpcrl trains in bf16 or fp32"),
    # Model and data the job could not load (more in FILE_CASES below, with files made by the test)
    ("model-missing", None, [*TESTBED, "model.path=./no-such-model"], "model.path: ./no-such-model does not exist"),
    ("model-hub-not-cached", None, [*TESTBED, "model.path=no-such-org/no-such-model"],
     "model.path: 'no-such-org/no-such-model' is neither a local directory nor a model in the Hugging Face cache"),
    ("data-missing", None, [*TESTBED, "data.path=/tmp/no-such-dir/prompts.jsonl"],
     "data.path: /tmp/no-such-dir/prompts.jsonl does not exist"),
    ("data-glob-empty", None, [*TESTBED, "data.path=no-such-dir/*.parquet"], "data.path: no file matches"),
    ("data-hub-not-cached", "model_name_or_path: demo:tiny\ndataset_name: no-such-org/no-such-data\n", TESTBED,
     "`huggingface-cli download --repo-type dataset no-such-org/no-such-data`"),
]


def _squeue_count(work: Path) -> int | None:
    """Jobs in the queue submitted from `work` (their working directory, the run directory, is under
    it): other sessions may share the testbed (scripts/test.sh can run two side by side)."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%Z"], capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return sum(line.startswith(str(work)) for line in out.stdout.splitlines()) if out.returncode == 0 else None


@pytest.mark.parametrize("case_id,recipe,args,expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input(hpcrl, case_id, recipe, args, expect):
    args = list(args)
    if recipe is not None:
        path = hpcrl.work.parent / "recipe.yaml"
        path.write_bytes(recipe if isinstance(recipe, bytes) else recipe.encode())
        args.append(str(path))
    before = _squeue_count(hpcrl.work)
    r = hpcrl("submit", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("hpcrl: error: ") and expect in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stdout == ""
    assert list(hpcrl.work.iterdir()) == [], "something was written"
    assert not (hpcrl.home / "registry.sqlite").exists(), "a job was registered"
    assert not os.path.exists("/tmp/hpcrl-pwned")
    if before is not None:
        assert _squeue_count(hpcrl.work) == before, "a job was submitted"


def test_there_are_enough_cases():
    assert len(CASES) >= 30


def test_bad_user_site_file(hpcrl, tmp_path):
    sites = tmp_path / "mysites"
    sites.mkdir()
    (sites / "broken.toml").write_text("gpus = [\n")
    (sites / "typo.toml").write_text('extends = "cuda"\n[node]\ngpu = 4\n')
    for name, expect in (("broken", "invalid TOML"), ("typo", 'site.node.gpu: unknown field (did you mean "gpus"?)')):
        r = hpcrl("render", "--site", name, env={"HPCRL_SITES_PATH": str(sites)})
        assert r.returncode == 2 and expect in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        assert list(hpcrl.work.iterdir()) == []


# (id, files to make under a fresh directory {inputs}, arguments after `hpcrl submit`, text the error must contain)
FILE_CASES = [
    ("model-no-weights", {"m/config.json": "{}", "m/tokenizer.json": "{}"}, ["model.path={inputs}/m"],
     "model.path: {inputs}/m has no weights (*.safetensors, *.bin"),
    ("model-no-config", {"m/model.safetensors": ""}, ["model.path={inputs}/m"], "has no config.json"),
    ("model-no-tokenizer", {"m/config.json": "{}", "m/model.safetensors": ""}, ["model.path={inputs}/m"],
     "model.path: {inputs}/m has no tokenizer vocabulary (tokenizer.json, tokenizer.model, vocab.json"),
    ("tokenizer-no-files", {"t/README.md": "x"}, ["model.tokenizer={inputs}/t"],
     "model.tokenizer: {inputs}/t has no tokenizer vocabulary"),
    # Issue #26, item 8: tokenizer_config.json alone failed on the node in the engine's words.
    ("tokenizer-config-only", {"t/tokenizer_config.json": "{}"}, ["model.tokenizer={inputs}/t"],
     "model.tokenizer: {inputs}/t has no tokenizer vocabulary (tokenizer.json"),
    ("data-no-prompt-column", {"q.jsonl": '{"question": "1+1=", "answer": "2"}\n'}, ["data.path={inputs}/q.jsonl"],
     "data.prompt_column: no 'prompt' column in {inputs}/q.jsonl (first row's columns: question, answer)"),
    ("data-split-single-file", {"p.jsonl": '{"prompt": "1+1="}\n'}, ["data.path={inputs}/p.jsonl", "data.split=test"],
     "data.split: 'test': data.path is a file or files, whose only split is \"train\""),
    ("data-first-row-not-json", {"p.jsonl": "{prompt: 1\n"}, ["data.path={inputs}/p.jsonl"], "p.jsonl: line 1 is not JSON"),
    ("data-dir-empty", {"d/notes.txt": "x"}, ["data.path={inputs}/d"], "holds no data files"),
    ("data-eval-split-missing", {"d/train.jsonl": '{"prompt": "1+1="}\n'},
     ["data.path={inputs}/d", "grpo.eval_strategy=steps"], "data.eval_split: no file in {inputs}/d is named for split 'test'"),
    ("reward-model-not-a-model", {"rm/README.md": "x"}, ["rewards=[{{model: {inputs}/rm}}]"],
     "rewards[0].model: {inputs}/rm is not a Hugging Face model directory"),
    ("lora-target-not-in-weights", {"m/config.json": "{}", "m/tokenizer.json": "{}", "m/model.safetensors.index.json":
                                    '{"weight_map": {"model.layers.0.self_attn.qkv_proj.weight": "a.safetensors", '
                                    '"model.layers.0.mlp.down_proj.weight": "a.safetensors", '
                                    '"model.norm.weight": "a.safetensors"}}'},
     ["model.path={inputs}/m", "model.use_peft=true", "model.lora_target_modules=[q_proj,k_proj]"],
     "model.lora_target_modules: 'q_proj', 'k_proj' match no module of {inputs}/m; its linear layers: down_proj, "
     "lm_head, qkv_proj"),
    ("deepspeed-conflict", {"ds.json": '{"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3}}'},
     ["trainer.engine=deepspeed", "trainer.deepspeed_config={inputs}/ds.json", "grpo.gradient_accumulation_steps=4"],
     "trainer.deepspeed_config (ds.json): gradient_accumulation_steps 8 conflicts with grpo.gradient_accumulation_steps "
     "4; set one of them"),
    ("deepspeed-json-invalid", {"ds.json": "{'stage': 3}"},
     ["trainer.engine=deepspeed", "trainer.deepspeed_config={inputs}/ds.json"],
     "trainer.deepspeed_config: {inputs}/ds.json is not valid JSON (line 1, column 2"),
    ("deepspeed-json-not-object", {"ds.json": "[3]"}, ["trainer.engine=deepspeed", "trainer.deepspeed_config={inputs}/ds.json"],
     "trainer.deepspeed_config: {inputs}/ds.json is not a DeepSpeed configuration (a JSON object), got list"),
    ("accelerate-fp16", {"acc.yaml": "distributed_type: DEEPSPEED\nmixed_precision: fp16\n"},
     ["trainer.engine=deepspeed", "trainer.accelerate_config={inputs}/acc.yaml"],
     "trainer.accelerate_config (acc.yaml): mixed_precision 'fp16': hpcrl trains in bf16 or fp32"),
    ("accelerate-two-jsons", {"acc.yaml": "deepspeed_config: {deepspeed_config_file: a.json}\n", "a.json": "{}",
                              "b.json": "{}"},
     ["trainer.engine=deepspeed", "trainer.accelerate_config={inputs}/acc.yaml", "trainer.deepspeed_config={inputs}/b.json"],
     "trainer.accelerate_config (acc.yaml): deepspeed_config_file and trainer.deepspeed_config both give a DeepSpeed JSON"),
    ("data-files-and-path", {"p.jsonl": '{"prompt": "1+1="}\n'},
     ["data.path={inputs}/p.jsonl", "data.data_files=[{inputs}/p.jsonl]"], "data.data_files: give data.path or"),
]


@pytest.mark.parametrize("case_id,files,args,expect", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_input_files(hpcrl, tmp_path, case_id, files, args, expect):
    """A model or dataset the login node can see but the job could not use: refused before anything is written."""
    made = tmp_path / "inputs"
    for name, text in files.items():
        (made / name).parent.mkdir(parents=True, exist_ok=True)
        (made / name).write_text(text)
    r = hpcrl("submit", *TESTBED, *(a.format(inputs=made) for a in args))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcrl: error: ") and expect.format(inputs=made) in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout and r.stdout == ""
    assert list(hpcrl.work.iterdir()) == [], "something was written"


_HIDE_VLLM = '''import sys
class _NoVllm:
    """This interpreter without vLLM and torchao, as a site's environment may be."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torchao"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoVllm())
'''


@pytest.mark.parametrize("args,expect", [
    ([*TESTBED, "inference.engine=vllm"], "inference.engine: vllm: no vllm in "),
    ([*TESTBED, r"grpo.vllm_structured_outputs_regex=\d+"],
     "grpo.vllm_structured_outputs_regex: structured outputs need the vLLM engine"),
    (["--site", "cuda", "-A", "abc123"], "inference.engine: auto found no vllm in "),
    ([*TESTBED, "grpo.optim=adamw_torch_8bit"], "grpo.optim: adamw_torch_8bit is torchao's 8-bit AdamW, and "),
], ids=["engine-vllm", "structured-outputs", "gpu-site-auto", "8bit-adamw"])
def test_an_engine_the_tasks_would_not_find_is_refused_on_the_login_node(hpcrl, tmp_path, args, expect):
    """Where the tasks run the login node's interpreter, vLLM missing from it is known before the job
    queues: inference.engine vllm; and auto where nothing else serves (structured outputs, a GPU site,
    whose auto never falls back to the transformers engine). The CPU's auto keeps its fallback. So is
    torchao missing for grpo.optim adamw_torch_8bit."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(_HIDE_VLLM)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH", "")]))}
    r = hpcrl("submit", *args, env=env)
    assert r.returncode == 2 and r.stderr.startswith("hpcrl: error: " + expect), (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and list(hpcrl.work.iterdir()) == [], r.stderr
    plain = hpcrl("plan", "--site", "testbed", env=env)          # the CPU's auto: the transformers engine
    assert plain.returncode == 0, plain.stderr
