"""The recipe: what a user writes (YAML) to describe a GRPO run, as typed dataclasses.

GRPO hyperparameters keep the names of TRL's GRPOConfig, so a TRL user's settings carry over.
Machine facts do not belong here; they live in the site profile (a recipe may override them in
its `site:` section).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from hpcrl.job import hfcache
from hpcrl.job.agent_config import IMPORT_PATH, AgentConfig
from hpcrl.job.config import closest
from hpcrl.job.demo import demo_name
from hpcrl.job.errors import UserError
from hpcrl.job.grpo_config import LOW_BIT_OPTIMS, GRPOConfig
from hpcrl.job.lora import LORA_MODULES_TO_SAVE


@dataclass(frozen=True)
class ModelConfig:
    # A local Hugging Face directory, or a model made locally with no download (hpcrl.compute.models.tiny):
    # "demo:<size>" (tiny/small/medium/base/large) is first warmed up on the demo task until it is
    # right ~40% of the time, so that GRPO visibly improves it (~3 s for tiny, longer for bigger
    # sizes); "demo:<size>:random" has random weights (GRPO does not learn the sums from there in a
    # demo's time); "demo:<size>:agent" is the agent demo's (examples/agent.yaml): its chat template
    # renders tools, and it is warmed up to call a calculator now and then (~40 s for tiny).
    path: str = demo_name("tiny")
    # A hub id's revision (TRL's model_revision): a branch, a tag or a full commit hash, found in the
    # Hugging Face cache as huggingface_hub put it there (hf download ID --revision R). A local
    # directory has none: submit warns that it is not used.
    revision: str = hfcache.MAIN
    # The tokenizer's directory (for the trainer, both engines and the exported model); "" = the model's.
    tokenizer: str = ""
    # The dtype of the weights outside the optimizer (the fp32 master weights and AdamW state stay
    # fp32): what the engines serve when inference.dtype is "auto", what the frozen reference model
    # is stored in (it still computes in the training dtype, grpo.bf16), and what the run's Hugging
    # Face model directories hold. "auto": the checkpoint's config.json dtype for those directories;
    # the engines keep their default and the reference the training dtype (no wider: same forward).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Also reaches the tokenizer and both engines: code shipped with the model or tokenizer runs.
    trust_remote_code: bool = False
    # The trainers' and the transformers engine's attention ("eager", "sdpa", "flash_attention_2",
    # ...; "" = transformers' choice). vLLM picks its own attention backend.
    attn_implementation: str = ""
    # LoRA, with the names and defaults of TRL's ModelConfig (hpcrl.compute.train.lora): adapters
    # B A on the target modules train in fp32 while the base weights stay frozen in the training
    # dtype; the reference model is the base (the adapters switched off), and the engines get the
    # merged weights W + lora_alpha / lora_r * B A (lora_alpha / sqrt(lora_r) with use_rslora); with
    # use_dora (DoRA) each adapted weight's rows are also rescaled to a trained magnitude:
    # m / ||W + s B A||_row * (W + s B A).
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: float = 32
    lora_dropout: float = 0.05
    # Module names (a name matches a module whose path ends with it, e.g. "q_proj"), "all-linear"
    # (every linear layer but the output head), or one regular expression over module paths;
    # None = peft's choice for the architecture (q_proj and v_proj for Llama and Qwen).
    lora_target_modules: Union[str, tuple[str, ...], None] = None
    lora_task_type: str = "CAUSAL_LM"
    use_rslora: bool = False
    use_dora: bool = False
    # Whole modules trained beside the adapters (TRL's lora_modules_to_save: peft keeps the original
    # frozen for the reference and trains a copy, fp32 with optimizer state, which the engines get
    # and the adapter directory holds): "lm_head" and "embed_tokens" (new tokens' rows, a head of
    # one's own), not where the head is tied to the embeddings. None = the adapters only.
    lora_modules_to_save: Optional[tuple[str, ...]] = None
    # Parameters adapted beside the modules (TRL's lora_target_parameters, peft's target_parameters):
    # a name matches a parameter whose path (less peft's wrappers) is it or ends with "." + it, e.g.
    # "mlp.experts.gate_up_proj" for the fused experts of a mixture-of-experts model (transformers 5
    # holds them as one 3-D parameter, which no module name reaches). peft takes them without dropout
    # or DoRA. None = modules only.
    lora_target_parameters: Optional[tuple[str, ...]] = None

    def validate(self, where: str) -> None:
        if not hfcache.REVISION.fullmatch(self.revision):
            raise UserError(f"{where}.revision: {self.revision!r} is not a hub revision: a branch, a tag or a "
                            f"commit hash (\"main\", \"v1.0\", \"refs/pr/3\")")
        if self.attn_implementation and not re.fullmatch(r"[\w./:-]+", self.attn_implementation):
            raise UserError(f"{where}.attn_implementation: {self.attn_implementation!r} is not an attention "
                            f"implementation's name (eager, sdpa, flash_attention_2, ...)")
        if not self.use_peft:
            for name, on in (("use_dora", self.use_dora), ("lora_modules_to_save", self.lora_modules_to_save),
                             ("lora_target_parameters", self.lora_target_parameters)):
                if on:
                    raise UserError(f"{where}.{name}: a LoRA setting: set {where}.use_peft too")
            return
        unknown = [m for m in self.lora_modules_to_save or () if m not in LORA_MODULES_TO_SAVE]
        if unknown:
            raise UserError(f"{where}.lora_modules_to_save: {unknown[0]!r}: {' and '.join(LORA_MODULES_TO_SAVE)} "
                            f"only in this version")
        if self.lora_r <= 0:
            raise UserError(f"{where}.lora_r: the adapters' rank must be a positive integer, got {self.lora_r}")
        if self.lora_alpha <= 0:
            raise UserError(f"{where}.lora_alpha: must be positive, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"{where}.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if self.lora_task_type != "CAUSAL_LM":
            raise UserError(f"{where}.lora_task_type: hpcrl trains causal language models: \"CAUSAL_LM\" "
                            f"(got {self.lora_task_type!r})")
        self._validate_target_parameters(where)
        targets = self.lora_target_modules
        if targets is not None:
            names = [targets] if isinstance(targets, str) else list(targets)
            if not names or any(not isinstance(n, str) or not n.strip() for n in names):
                raise UserError(f"{where}.lora_target_modules: module names, \"all-linear\" or one regular "
                                f"expression, got {targets!r}")
            if isinstance(targets, str) and targets != "all-linear":
                try:
                    re.compile(targets)
                except re.error as e:
                    raise UserError(f"{where}.lora_target_modules: {targets!r} is not a regular expression: {e}")

    def _validate_target_parameters(self, where: str) -> None:
        names = self.lora_target_parameters
        if names is None:
            return
        if not names or any(not isinstance(n, str) or not re.fullmatch(r"[\w.]+", n) for n in names):
            raise UserError(f"{where}.lora_target_parameters: parameter names, e.g. [mlp.experts.gate_up_proj, "
                            f"mlp.experts.down_proj], got {names!r}")
        # peft's ParamWrapper refuses both (the dropout cannot be factored out of a merged weight).
        if self.lora_dropout:
            raise UserError(f"{where}.lora_dropout: {self.lora_dropout}: peft's adapters on parameters "
                            f"({where}.lora_target_parameters) take no dropout; set it to 0")
        if self.use_dora:
            raise UserError(f"{where}.use_dora: peft's adapters on parameters ({where}.lora_target_parameters) "
                            f"have no DoRA; leave one of the two out")


def engine_dtype(inference_dtype: str, model_dtype: str) -> str:
    """What the engine is asked to serve in: inference.dtype, else model.dtype ("auto": its default)."""
    return model_dtype if inference_dtype == "auto" else inference_dtype


# datasets' packaged builders (datasets 5.2): a mixture source whose path names one reads the files
# of its data_files or data_dir (relative to the directory hpcrl runs in); a test holds this equal
# to datasets.packaged_modules. Kept here because the login side never imports datasets.
DATASET_BUILDERS = ("arrow", "audiofolder", "conll", "csv", "eval", "fasta", "fastq", "genbank", "harbor", "hdf5",
                    "iceberg", "imagefolder", "json", "lance", "meshfolder", "mmcif", "niftifolder", "pandas",
                    "parquet", "pdb", "pdffolder", "text", "tsfile", "videofolder", "vortex", "webdataset", "xml")


@dataclass(frozen=True)
class DataSource:
    """One dataset of a mixture, TRL's DatasetConfig (TRL 1.16): loaded as TRL's get_dataset loads
    it, datasets.load_dataset(path, name, data_dir, data_files, split), then only `columns` kept
    (None: all). `path` is what load_dataset takes: a builder ("json", "csv", "parquet", ...) with
    data_files or data_dir, a directory of data files, or a hub dataset id in the Hugging Face cache.
    `fraction`: this dataset's share of the mixture, set for all of them or none (TRL's rule: the
    first round(share * N) rows of each, N as large as no dataset runs out)."""
    path: str
    name: Optional[str] = None
    data_dir: Optional[str] = None
    data_files: Union[str, tuple[str, ...], dict[str, Union[str, tuple[str, ...]]], None] = None
    split: str = "train"
    columns: Optional[tuple[str, ...]] = None
    fraction: Optional[float] = None

    def validate(self, where: str) -> None:
        if not self.path.strip():
            raise UserError(f"{where}.path: empty; give what datasets.load_dataset takes (a builder such as "
                            f"json with data_files, a directory of data files, or a cached hub dataset id)")
        if not self.split.strip():
            raise UserError(f"{where}.split: empty; give a split name such as \"train\"")
        if self.columns is not None:
            if not self.columns or any(not c.strip() for c in self.columns):
                raise UserError(f"{where}.columns: a list of column names (leave it out for every column), "
                                f"got {list(self.columns)!r}")
            twice = next((c for i, c in enumerate(self.columns) if c in self.columns[:i]), None)
            if twice is not None:
                raise UserError(f"{where}.columns: {twice!r} is named twice")
        if self.fraction is not None and not self.fraction >= 0:
            raise UserError(f"{where}.fraction: the dataset's share of the mixture must be >= 0, got {self.fraction}")


@dataclass(frozen=True)
class DataConfig:
    # What datasets.load_dataset(path) reads, as TRL's dataset_name: a local .jsonl/.json/.parquet/.csv
    # file or a glob of them, a directory of such files, a datasets save_to_disk directory, or a hub
    # dataset id already in the Hugging Face cache (compute nodes run offline); "demo" = the built-in task.
    path: str = "demo"
    # The dataset's configuration (TRL's dataset_config; load_dataset's name); "" = its default.
    config: str = ""
    # Local data files or globs, as load_dataset's data_files, instead of data.path (leave path unset).
    data_files: tuple[str, ...] = ()
    # A single file, a glob or data_files have one split, "train".
    split: str = "train"
    # The split grpo.eval_strategy evaluates on (TRL's dataset_test_split); the demo task has one.
    eval_split: str = "test"
    prompt_column: str = "prompt"
    shuffle: bool = True
    # A mixture instead of data.path, TRL's `datasets` (DatasetMixtureConfig): every source loaded in
    # order and concatenated, as TRL's get_dataset does. Its splits are "train" and, with
    # test_split_size, "test"; data.split and data.eval_split pick from them as TRL's
    # dataset_train_split and dataset_test_split do.
    datasets: tuple[DataSource, ...] = ()
    # TRL's test_split_size: that share (0 < x < 1) or number of rows of the mixture becomes "test"
    # (datasets' train_test_split). Seeded with grpo.seed where TRL leaves it unseeded: every rank
    # must draw the same split.
    test_split_size: Union[int, float, None] = None

    def validate(self, where: str) -> None:
        if not self.datasets:
            if self.test_split_size is not None:
                raise UserError(f"{where}.test_split_size: splits a mixture only (give {where}.datasets), as in TRL")
            return
        for other, unset in (("path", "demo"), ("data_files", ()), ("config", "")):
            if getattr(self, other) != unset:
                raise UserError(f"{where}.{other}: give {where}.{other} or {where}.datasets, not both (a "
                                f"mixture sets path, data_files and name per dataset)")
        fractions = [s.fraction for s in self.datasets]
        if None in fractions and any(f is not None for f in fractions):
            i = fractions.index(None)
            raise UserError(f"{where}.datasets[{i}].fraction: unset while another dataset sets one; set a "
                            f"fraction for every dataset of the mixture or for none (TRL's rule)")
        if fractions[0] is not None and not sum(fractions) > 0:
            raise UserError(f"{where}.datasets: the fractions add up to 0; give at least one dataset a share")
        size = self.test_split_size
        if size is not None and not (isinstance(size, int) and size >= 1 or isinstance(size, float) and 0 < size < 1):
            raise UserError(f"{where}.test_split_size: a share of the rows (0 < x < 1) or a number of rows "
                            f"(>= 1), got {size!r}")
        splits = ("train", "test") if size is not None else ("train",)
        if self.split not in splits:
            raise UserError(f"{where}.split: {self.split!r}: a mixture's splits are {', '.join(splits)}"
                            + ("" if size is not None else " (test_split_size adds \"test\")"))


# trl.rewards' functions (TRL 1.16): a recipe may name them alone, as TRL's CLI does (`func: accuracy_reward`).
# Kept here because the login side never imports trl; tests check the list against trl.rewards.
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_cosine_scaled_reward",
               "get_repetition_penalty_reward", "get_soft_overlong_punishment")
# Those of them that import math_verify when they score.
TRL_REWARDS_MATH_VERIFY = ("accuracy_reward", "reasoning_accuracy_reward", "get_cosine_scaled_reward")


def reward_import_path(func: str) -> str:
    """A TRL reward function's bare name -> its import path; any other func as it is."""
    return f"trl.rewards:{func}" if func in TRL_REWARDS else func


@dataclass(frozen=True)
class RewardSpec:
    """A reward function, called as TRL's GRPOTrainer calls it (hpcrl.compute.train.rewards).

    ``func``: "package.module:function", a module beside the recipe or in the current directory
    ("my_rewards:correct", copied into the run directory), or one of TRL_REWARDS by name. With
    ``kwargs`` the imported object is a factory called with them to make the function (TRL's
    get_soft_overlong_punishment). ``name``: the one its metrics take (rewards/<name>); "" = the
    function's own, as TRL names it.

    ``model`` instead of ``func``: a local Hugging Face sequence-classification model directory
    (TRL's reward_model_name_or_path); its first logit for prompt + completion is the reward. It
    runs on the trainers, sharded like the reference model (hpcrl.compute.train.reward_model)."""
    func: str = ""
    weight: float = 1.0
    name: str = ""
    kwargs: Optional[dict[str, Any]] = None
    model: str = ""

    def validate(self, where: str) -> None:
        if bool(self.func) == bool(self.model):
            raise UserError(f"{where}: give func (a reward function) or model (a reward model's directory), "
                            f"{'not both' if self.func else 'one of them'}")
        if self.model:
            if self.kwargs is not None:
                raise UserError(f"{where}.kwargs: only for a func (a factory's arguments), not a reward model")
            return
        if not IMPORT_PATH.match(self.func):
            raise UserError(f"{where}.func: {self.func!r} is not an import path like \"package.module:function\"")
        if "." not in self.func and ":" not in self.func and self.func not in TRL_REWARDS:
            hint = closest(self.func, TRL_REWARDS) or f" ({', '.join(TRL_REWARDS)})"
            raise UserError(f"{where}.func: {self.func!r} is neither an import path like \"my_rewards:function\" "
                            f"nor one of TRL's reward functions{hint}")
        if re.search(r"[\x00-\x1f\x7f]", self.name):
            raise UserError(f"{where}.name: control characters (newline, tab, ...) are not allowed")


def expand_shorthands(data: dict) -> dict:
    """A raw recipe with its shorthands written out: `rewards:` may be a list of bare import paths
    or TRL names (as TRL's reward_funcs), or a single one. An agent recipe (tools, environments, a
    rollout function) that names no rewards has none (its environment's get_reward may score it, as
    in TRL), not the demo task's."""
    rewards = data.get("rewards")
    if isinstance(rewards, str):
        rewards = [rewards]
    if isinstance(rewards, list):
        data = {**data, "rewards": [{"func": r} if isinstance(r, str) else r for r in rewards]}
    agent = data.get("agent")
    if "rewards" not in data and isinstance(agent, dict) and (agent.get("tools") or agent.get("environment_factory")
                                                              or agent.get("rollout_func")):
        data = {**data, "rewards": []}
    return data


def _default_rewards() -> tuple[RewardSpec, ...]:
    # The demo task's rewards (hpcrl.compute.train.rewards.DEMO_REWARDS): the answer, and a short format.
    return (RewardSpec("hpcrl.compute.train.rewards:demo_correct", 1.0), RewardSpec("hpcrl.compute.train.rewards:demo_format", 0.5))


def auto_engines(device: str) -> tuple[str, ...]:
    """What `inference.engine: auto` tries on a site of `device`, best first. On a GPU site only vLLM:
    the transformers engine generates without paging or batching across requests and takes every
    sync's whole model over a socket, a slow job nobody chose. Elsewhere the transformers engine is
    the fallback. (The login node refuses a missing vLLM by it; the job chooses by it.)"""
    return ("vllm",) if device == "cuda" else ("vllm", "transformers")


@dataclass(frozen=True)
class InferenceConfig:
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    gpus: int = 1                   # GPUs per node that generate, in engines of tensor_parallel_size GPUs
    tensor_parallel_size: int = 1   # GPUs per engine: gpus / tensor_parallel_size engines per node
    gpu_memory_utilization: float = 0.85
    # The engine's context, prompt and completion together (TRL's vllm_max_model_length). None: the
    # model's own, as vLLM derives it from config.json and the tokenizer (hpcrl.job.context).
    max_model_len: Optional[int] = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # None: on for the CPU build, off on GPUs, where CUDA/HIP graphs speed up decoding for ~0.5 GiB.
    enforce_eager: Optional[bool] = None
    engine_args: dict[str, Any] = field(default_factory=dict)   # passed to the engine as is
    sync_every: int = 1             # optimizer steps between weight syncs
    # Sample the next generation while the trainers train on this one (the server's GPU would
    # otherwise idle through training): completions are then one generation behind the policy.
    # grpo.vllm_importance_sampling_correction reweights for the lag (README: what it did on the demo).
    overlap_generation: bool = False
    # Asynchronous generation (TRL AsyncGRPOTrainer's max_staleness): up to this many generations are
    # asked for ahead of the one training, and the engines sample them back to back, taking each
    # weight sync between two requests. A completion more than this many syncs behind the policy
    # when its turn comes is dropped (counted: sample/dropped_stale_total). 0: synchronous; 1 is
    # overlap_generation (which sets it). README: "Asynchronous generation".
    max_staleness: int = 0
    # Where a sync lands in the engines while generations are in flight (max_staleness >= 1).
    # between_requests: between two whole generations; a completion is sampled with one version.
    # in_flight (PipelineRL's): the engines serve every request as it comes (continuous batching
    # across generations, per sample) and take a sync between two engine steps, so requests under
    # way go on with the new weights; each token's version is recorded, a completion's staleness
    # counts from its first token. An agent's rollout goes on with the new weights from the next
    # token, in the turn under way or the next (not with agent.rollout_func).
    weight_update: Literal["between_requests", "in_flight"] = "between_requests"
    sync_bucket_mb: int = 256       # gather/send granularity: bounds the sender's extra memory
    start_timeout_s: float = 600.0  # how long trainers wait for the server to come up
    # A trainer's wait for one server answer. A generation's wait grows with its work: this plus
    # generation_s_per_ktoken for every 1,000 completion tokens the node's trainers asked for
    # (completions x max tokens), since the server generates them as one batch. 2 s per 1,000
    # assumes the server sustains 500 tokens/s: a hang is still caught, a slow real model is not
    # mistaken for one (14B, 7 trainers x 128 completions x 4k tokens: 600 + 7,340 s).
    request_timeout_s: float = 600.0
    generation_s_per_ktoken: float = 2.0

    @property
    def staleness(self) -> int:
        """The staleness bound the trainers keep: max_staleness, or 1 with overlap_generation."""
        return max(self.max_staleness, 1 if self.overlap_generation else 0)

    @property
    def in_flight(self) -> bool:
        """Syncs land between two engine steps, in requests under way (weight_update)."""
        return self.weight_update == "in_flight"

    def eager(self, device: str) -> bool:
        """enforce_eager as the engine gets it: the recipe's, else on for the CPU build only."""
        return device == "cpu" if self.enforce_eager is None else self.enforce_eager

    def validate(self, where: str) -> None:
        if self.gpus < 1:
            raise UserError(f"{where}.gpus: must be at least 1, got {self.gpus}")
        if self.tensor_parallel_size < 1 or self.gpus % self.tensor_parallel_size:
            raise UserError(f"{where}.tensor_parallel_size: {self.tensor_parallel_size} must divide {where}.gpus="
                            f"{self.gpus} (the node's GPUs that generate, in engines of tensor_parallel_size GPUs "
                            f"each); for one engine of {self.tensor_parallel_size} GPUs set {where}.gpus="
                            f"{self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(f"{where}.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UserError(f"{where}.max_model_len: must be at least 1, or null for the model's own context, "
                            f"got {self.max_model_len}")
        if self.max_staleness < 0:
            raise UserError(f"{where}.max_staleness: must be >= 0 (0: synchronous generation), got {self.max_staleness}")
        if self.in_flight and self.max_staleness < 1:
            raise UserError(f"{where}.weight_update: in_flight lands syncs in generations under way; it needs "
                            f"{where}.max_staleness >= 1 (generations asked for ahead), got {self.max_staleness}")
        for name in ("sync_every", "sync_bucket_mb"):
            if getattr(self, name) < 1:
                raise UserError(f"{where}.{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("start_timeout_s", "request_timeout_s", "generation_s_per_ktoken"):
            if getattr(self, name) <= 0:
                raise UserError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class TrainerConfig:
    # The same GRPO loop, loss and metrics either way; only model wrapping, the optimizer step, the
    # gather for a weight sync and checkpoints differ. "deepspeed" is ZeRO stage 3, set up by hpcrl
    # from the recipe (hpcrl.job.deepspeed), for users whose settings are DeepSpeed's.
    engine: Literal["fsdp2", "deepspeed"] = "fsdp2"
    # "auto" picks HSDP (shard inside a node, replicate across nodes) when the model with its
    # optimizer state fits one node's trainers, else full sharding. With trainer.engine=deepspeed,
    # HSDP is ZeRO++'s hierarchical partition (zero_hpz_partition_size = each node's trainers).
    mesh: Literal["auto", "fsdp", "hsdp"] = "auto"
    # A DeepSpeed JSON of the user's (engine deepspeed), as TRL's `deepspeed` takes it: a path (a
    # relative one from the current directory, else beside the recipe), or the configuration itself
    # as a mapping. Its keys that hpcrl owns (batch sizes, gradient accumulation and clipping,
    # bf16/fp16, the ZeRO stage, optimizer and scheduler) must agree with the recipe or be "auto";
    # the others reach deepspeed.initialize as they are. Read once, on the login node: job.json
    # keeps its content (JobSpec.deepspeed_user), so a later edit of the file changes no job.
    deepspeed_config: Union[str, dict[str, Any]] = ""
    # An accelerate config file (`accelerate launch --config_file`, as TRL's multi-node recipes
    # pair with DeepSpeed): its DeepSpeed settings are read as a DeepSpeed JSON's; what hpcrl
    # decides itself (processes, machines, rendezvous) is named on stderr, not followed.
    accelerate_config: str = ""
    # ZeRO-3 offload to host memory (engine deepspeed only): the optimizer state with the fp32
    # master weights and gradients, or the parameters. Slower steps for a model that would not
    # fit otherwise; FSDP2 here keeps everything on the GPUs, so fsdp2 refuses both.
    offload_optimizer: bool = False
    offload_params: bool = False
    reference_offload: bool = False     # keep the reference model on CPU (explicit, never by accident)
    activation_checkpointing: bool = False
    threads: int = 0                    # torch threads per trainer; 0 = its pinned cores
    # Completion tokens whose log-probabilities are computed at once: the fp32 [tokens x vocabulary]
    # temporaries exist for one chunk at a time, never for a whole micro-batch. 512 tokens of a
    # 152k vocabulary is ~300 MiB of fp32 per chunk (scripts/bench_memory.py).
    logprob_chunk_tokens: int = 512

    def validate(self, where: str) -> None:
        for name in ("threads",):
            if getattr(self, name) < 0:
                raise UserError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.logprob_chunk_tokens < 1:
            raise UserError(f"{where}.logprob_chunk_tokens: must be at least 1, got {self.logprob_chunk_tokens}")
        if self.engine == "deepspeed":
            return
        # Explicit, never a guess: a DeepSpeed setting under FSDP2 would silently change nothing.
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name):
                raise UserError(f"{where}.{name}: ZeRO-3 offload to host memory, only with {where}.engine=deepspeed "
                                f"(the engine is {self.engine}, which keeps everything on the GPUs)")
        for name in ("deepspeed_config", "accelerate_config"):
            if getattr(self, name):
                raise UserError(f"{where}.{name}: a DeepSpeed configuration, read only with {where}.engine=deepspeed; "
                                f"set {where}.engine=deepspeed to train with DeepSpeed ZeRO-3 (the engine is "
                                f"{self.engine})")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0                  # optimizer steps between checkpoints; 0 = only on signal/end
    keep: int = 2
    dir: str = ""                   # "" = <run_dir>/checkpoints
    # Where the Hugging Face model directories go (TRL's output_dir): the final model, and
    # checkpoint-<step> inside it every grpo.save_steps. "" = <run_dir>/model. A relative path is
    # taken from the directory hpcrl was run in, as TRL does.
    output_dir: str = ""
    # The largest safetensors file of a Hugging Face model directory the run writes (<run_dir>/model,
    # grpo.save_steps, `hpcrl export`), in GB of 10^9 bytes as Hugging Face's max_shard_size="5GB".
    model_max_shard_size_gb: float = 5.0
    # With model.use_peft the model directories are peft adapter directories; this also writes the
    # merged model (base + adapters, a plain Hugging Face model) into <model directory>/merged.
    save_merged_model: bool = False
    # The dtype of the Hugging Face model directories the run writes; "auto" = model.dtype's rule
    # (set: it; else the checkpoint's). A TRL configuration that names no dtype saves float32, as
    # TRL does (its CLI loads the model in float32, and saves it so).
    model_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    def validate(self, where: str) -> None:
        if self.every < 0:
            raise UserError(f"{where}.every: must be >= 0, got {self.every}")
        if self.model_max_shard_size_gb <= 0:
            raise UserError(f"{where}.model_max_shard_size_gb: must be > 0, got {self.model_max_shard_size_gb}")
        if self.keep < 1:
            raise UserError(f"{where}.keep: must be at least 1, got {self.keep}")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = False
    wandb: bool = False             # offline mode: compute nodes rarely reach the internet
    # TRL's log_completions: every completion with its prompt, rewards and advantage goes to
    # <run_dir>/completions.jsonl, and this many of each step's are printed; 0 = off.
    log_completions: int = 0

    def validate(self, where: str) -> None:
        if self.log_completions < 0:
            raise UserError(f"{where}.log_completions: must be >= 0 (0 = off), got {self.log_completions}")


@dataclass(frozen=True)
class LaunchConfig:
    # Every wait on a peer has a bound: how long ranks wait for each other to appear, and how
    # long a collective may take before the job is declared broken.
    rendezvous_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    # Silence before a live peer counts as gone (a frozen node). Deaths are seen at once (a closed
    # socket); long, since a collective or an import may hold a busy rank's GIL for a minute.
    peer_failure_timeout_s: float = 300.0
    # The trainers' wait for trainer rank 0 to read the checkpoint (policy, then reference), apart
    # from collective_timeout_s: 30B+ read in fp32 from a parallel file system takes many minutes.
    model_load_timeout_s: float = 1800.0
    # Where a task learns its rank: "auto" = MPI, else the SLURM_* variables when MPI is missing or
    # sees a world of one (srun's --mpi plugin does not match the MPI); "mpi" or "slurm" forces one.
    rendezvous: Literal["auto", "mpi", "slurm"] = "auto"
    # How many times the batch script requeues a job that checkpointed at Slurm's warning signal
    # (each attempt must also have trained a step); then it stops and `hpcrl submit --resume` goes on.
    max_restarts: int = 50

    def validate(self, where: str) -> None:
        for name in ("rendezvous_timeout_s", "collective_timeout_s", "peer_failure_timeout_s", "model_load_timeout_s"):
            if getattr(self, name) <= 0:
                raise UserError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise UserError(f"{where}.max_restarts: must be >= 0 (0 = never requeue), got {self.max_restarts}")


@dataclass(frozen=True)
class Resources:
    """Slurm resources; flags (-N, -t, -A, -p, -q, -J) override these."""
    nodes: int = 1
    time: str = "00:30:00"
    account: str = ""
    partition: str = ""
    qos: str = ""
    # Extra options, rendered quoted: e.g. ["--mail-type=END"], ["--exclusive"].
    sbatch_options: tuple[str, ...] = ()
    srun_options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Recipe:
    name: str = "hpcrl-demo"
    # "train" runs GRPO; "probe" makes every task print the placement row it takes and exit.
    # "control": the same report without torch (bytes echo, MPI allreduce), for launches of hundreds of ranks.
    mode: Literal["train", "probe", "control"] = "train"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: tuple[RewardSpec, ...] = field(default_factory=_default_rewards)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    # Multi-turn tool calling (hpcrl.job.agent_config): tools, environments, their bounds.
    agent: AgentConfig = field(default_factory=AgentConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    resources: Resources = field(default_factory=Resources)
    # Overrides of the site profile's fields, merged over it (hpcrl.login.profiles.load).
    site: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str) -> None:
        if not self.rewards and not self.agent.environment_factory:
            raise UserError("rewards: at least one reward function is required (an agent recipe may leave them "
                            "out only with agent.environment_factory, whose environment scores with get_reward)")
        if self.grpo.max_tool_calling_iterations is not None and not self.agent.enabled:
            raise UserError("grpo.max_tool_calling_iterations: bounds an agent's tool calls; it needs agent.tools "
                            "or agent.environment_factory (leave it unset otherwise)")
        if self.grpo.optim in LOW_BIT_OPTIMS and self.trainer.engine == "deepspeed":
            raise UserError(f"grpo.optim: {self.grpo.optim} with trainer.engine=fsdp2 only in this version (ZeRO-3 "
                            f"keeps its own flat fp32 optimizer partitions)")
        if self.grpo.cast_lm_head_to_fp32:
            if self.trainer.engine == "deepspeed":
                raise UserError("grpo.cast_lm_head_to_fp32: with trainer.engine=fsdp2 only in this version (ZeRO-3 "
                                "computes every parameter in one dtype)")
            targets = self.model.lora_target_modules
            if self.model.use_peft and isinstance(targets, (list, tuple)) and "lm_head" in targets:
                raise UserError("grpo.cast_lm_head_to_fp32: not with an adapter on the LM head (lm_head in "
                                "model.lora_target_modules), as TRL; leave lm_head out or the option off")
            if self.model.use_peft and "lm_head" in (self.model.lora_modules_to_save or ()):
                raise UserError("grpo.cast_lm_head_to_fp32: not with a trained copy of the LM head (lm_head in "
                                "model.lora_modules_to_save); leave one of the two out")
        if self.grpo.vllm_structured_outputs_regex is not None and self.inference.engine == "transformers":
            raise UserError("grpo.vllm_structured_outputs_regex: structured outputs need the vLLM engine "
                            "(inference.engine: vllm or auto); the transformers engine samples free text")
        if self.checkpoint.save_merged_model and not self.model.use_peft:
            raise UserError("checkpoint.save_merged_model: only with model.use_peft (without LoRA the model "
                            "directory is the whole model already)")
        if self.model.use_peft:
            # With LoRA the reference model is the policy with its adapters switched off: there is
            # no second copy of the weights to mix into, or to keep on the host.
            if self.grpo.sync_ref_model:
                raise UserError("grpo.sync_ref_model: not with model.use_peft (the reference model is the frozen "
                                "weights themselves, with the adapters switched off)")
            if self.trainer.reference_offload:
                raise UserError("trainer.reference_offload: not with model.use_peft (the reference model is the "
                                "policy's own base weights, there is no copy to offload)")
            if self.trainer.engine == "deepspeed":
                raise UserError("trainer.engine=deepspeed: LoRA (model.use_peft) trains with trainer.engine=fsdp2 "
                                "only in this version")
