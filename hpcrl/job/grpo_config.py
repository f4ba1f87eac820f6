"""The recipe's grpo section: TRL's GRPOConfig fields (TRL 1.16), their defaults and checks, and the
built-in demo task's tuned values. The rest of the recipe is hpcrl.job.recipe."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from hpcrl.job.config import closest
from hpcrl.job.errors import UserError

__all__ = ["LOSS_TYPES", "OPTIMS", "LOW_BIT_OPTIMS", "BNB_8BIT_ADAMW", "SCHEDULER_KWARGS", "SCHEDULER_REQUIRED", "SCHEDULERS_ON_METRICS", "GRPOConfig",
           "DEMO_GRPO"]

# As hpcrl.compute.train.loss.LOSS_TYPES (TRL 1.16); kept here because the login side never imports torch.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# grpo.optim: the TRL (transformers) names of the AdamW that hpcrl runs. adamw_torch_8bit keeps the
# two Adam moments block-quantized in 8 bits (torchao's AdamW8bit, blocks of 256, as transformers
# builds it for that name). Not adamw_torch_4bit: torchao 0.18's AdamW4bit step does not compile
# over FSDP2's shards on the CPU (an inductor size assertion).
OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_8bit")
LOW_BIT_OPTIMS = ("adamw_torch_8bit",)
# transformers' names of bitsandbytes' 8-bit AdamW: its kernels take plain tensors, not the DTensor
# shards FSDP2 trains.
BNB_8BIT_ADAMW = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
# grpo.lr_scheduler_type: every transformers.SchedulerType that steps once per optimizer step, with
# the lr_scheduler_kwargs its schedule function takes (transformers.optimization; a test holds the
# names to transformers'), and those of them it cannot go without.
SCHEDULER_KWARGS = {
    "linear": (), "constant": (), "constant_with_warmup": (),
    "cosine": ("num_cycles",), "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"), "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": ("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio",
                            "num_cycles"),
}
SCHEDULER_REQUIRED = {"warmup_stable_decay": ("num_decay_steps",)}
# transformers' schedules that step on an evaluation metric, not once per optimizer step.
SCHEDULERS_ON_METRICS = ("reduce_lr_on_plateau", "greedy")


@dataclass(frozen=True)
class GRPOConfig:
    """Names, meaning and defaults as in trl.GRPOConfig (TRL 1.16): a field a recipe leaves out
    trains as TRL would. The built-in demo task sets its own tuned values (DEMO_GRPO)."""
    learning_rate: float = 1e-6
    per_device_train_batch_size: int = 8       # completions per trainer and optimizer step
    gradient_accumulation_steps: int = 1
    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: Optional[float] = None           # None = off
    repetition_penalty: float = 1.0         # 1.0 = off
    # Passed as is to the engine's sampling call (vLLM's SamplingParams, transformers' generate),
    # after and over the settings above, as TRL does.
    generation_kwargs: Optional[dict[str, Any]] = None
    # TRL's: every completion matches this regular expression (vLLM's structured outputs, over a
    # structured_outputs in generation_kwargs; the vLLM engine only). None = free text.
    vllm_structured_outputs_regex: Optional[str] = None
    # TRL's (transformers'): the trainers' fp32 matmuls in TF32 (True) or full fp32 (False) on NVIDIA
    # GPUs of Ampere or newer; None = torch's default. Refused where no GPU has TF32, as TRL does.
    tf32: Optional[bool] = None
    # Passed to the tokenizer's apply_chat_template when conversational prompts are rendered.
    chat_template_kwargs: Optional[dict[str, Any]] = None
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    num_iterations: int = 1
    # One generation, TRL's way: steps_per_generation micro-batches of per_device_train_batch_size
    # completions per trainer (or generation_batch_size completions over all trainers); neither:
    # gradient_accumulation_steps, one optimizer step's worth. A generation larger than that trains
    # several optimizer steps, each on its own slice (num_iterations times over).
    steps_per_generation: Optional[int] = None
    generation_batch_size: Optional[int] = None
    loss_type: str = "dapo"
    # TRL's booleans too: true = "group", false = "none" (normalized in __post_init__).
    scale_rewards: Union[Literal["group", "batch", "none"], bool] = "group"
    mask_truncated_completions: bool = False
    # An agent's tool-calling turns per completion (the recipe's agent section); None = no bound:
    # a completion ends at a turn without a tool call, or at max_completion_length.
    max_tool_calling_iterations: Optional[int] = None
    importance_sampling_level: Literal["token", "sequence"] = "token"    # "sequence": GSPO
    delta: Optional[float] = None           # two-sided clipping (INTELLECT-2): the ratio is capped at delta
    off_policy_mask_threshold: Optional[float] = None    # DeepSeek-V3.2's off-policy sequence mask
    use_bias_correction_kl: bool = True
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0               # static entropy bonus: loss - entropy_coef * mean token entropy
    # TRL's adaptive entropy control (Skywork-OR1), entropy_coef its start: after each optimizer step the
    # coefficient moves by entropy_coef_delta, up while the step's mean token entropy (every trainer's
    # loss tokens) is at or below entropy_target, down above it, within [entropy_coef_min, _max]; the
    # bonus applies only while the last step's entropy was at or below the target.
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    # A mixture of experts' load-balancing loss, added as TRL adds it: coef x the routers' aux loss;
    # None = the model config's own router_aux_loss_coef (0 for a dense model).
    router_aux_loss_coef: Optional[float] = None
    # Train only on the tokens whose entropy is in this top fraction of the micro-batch's (over every
    # trainer), as TRL's "Beyond the 80/20 rule" option; 1.0 = every token.
    top_entropy_quantile: float = 1.0
    # Every ref_model_sync_steps optimizer steps: reference = alpha * policy + (1 - alpha) * reference.
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    disable_dropout: bool = False           # every dropout module of policy and reference gets p = 0
    # NEFTune (transformers' hook, as TRL gets it): uniform noise of +-alpha / sqrt(L x d) on the
    # policy's input embeddings in its training forwards; None = off.
    neftune_noise_alpha: Optional[float] = None
    # The LM head of policy and reference computes in fp32 on the bf16 hidden states (TRL's option, as
    # the ScaleRL recipe advises): fp32 logits. With a head tied to the input embeddings, the group
    # they share (embeddings, final norm, head) computes in fp32, the embeddings' output cast back.
    cast_lm_head_to_fp32: bool = False
    # Reweights each completion by pi_trainer / pi_sampler (the engine's numerics, and the lag of
    # inference.overlap_generation). It costs a forward pass a step (README: what it did on the demo).
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_min: Optional[float] = None
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    # Optimizer steps; -1 = num_train_epochs passes over the prompts (the trainer counts them:
    # each generation of prompts gives num_iterations optimizer steps).
    max_steps: int = -1
    num_train_epochs: float = 3.0
    # Linear warmup: a whole number of steps, or a fraction (< 1) of all steps, as transformers'.
    warmup_steps: float = 0.0
    # Any of SCHEDULER_KWARGS: transformers.get_scheduler's names.
    lr_scheduler_type: str = "linear"
    # transformers.get_scheduler's scheduler_specific_kwargs (cosine: num_cycles; cosine_with_min_lr:
    # min_lr or min_lr_rate; warmup_stable_decay: num_decay_steps, ...).
    lr_scheduler_kwargs: Optional[dict[str, Any]] = None
    # AdamW: "adamw_torch" (torch's default kernel), fused, or with 8-bit moments (OPTIMS).
    optim: str = "adamw_torch_fused"
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    seed: int = 42
    gradient_checkpointing: bool = True
    # Mixed precision: "auto" = bf16 compute with fp32 reduce on GPU, fp32 on CPU.
    bf16: Optional[bool] = None
    # Hugging Face model directories <output_dir>/checkpoint-<step>/ (checkpoint.output_dir), as
    # TRL's: "steps" every save_steps optimizer steps and at the last (0 = only the final model),
    # "epoch" after each pass over the prompts, "no" only the final model.
    save_strategy: Literal["no", "steps", "epoch"] = "steps"
    save_steps: int = 500
    save_total_limit: Optional[int] = None  # keep only this many newest checkpoint-<step> directories
    # Evaluation on the data's eval_split (hpcrl.compute.train.evaluation): "steps" = every
    # eval_steps optimizer steps (None: 10, TRL's logging_steps; a fraction < 1 of max_steps) and
    # after the last, "epoch" = after each pass over the prompts; per_device_eval_batch_size
    # completions per trainer and request, num_generations_eval (None: num_generations) per prompt.
    eval_strategy: Literal["no", "steps", "epoch"] = "no"
    eval_steps: Optional[float] = None
    eval_on_start: bool = False
    per_device_eval_batch_size: int = 8
    num_generations_eval: Optional[int] = None

    def validate(self, where: str) -> None:
        # learning_rate 0 is TRL's to take too: such a run trains nothing, and its summary says so.
        if self.learning_rate < 0:
            raise UserError(f"{where}.learning_rate: must be >= 0, got {self.learning_rate}")
        positive = ("per_device_train_batch_size", "gradient_accumulation_steps",
                    "num_generations", "max_completion_length", "temperature", "num_iterations",
                    "adam_epsilon")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UserError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise UserError(f"{where}.num_generations: must be at least 2 (advantages are relative "
                            f"within a group), got {self.num_generations}")
        for name in ("beta", "epsilon", "weight_decay", "max_grad_norm", "top_k", "save_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"{where}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise UserError(f"{where}.max_tool_calling_iterations: must be >= 0, or null for no bound, "
                            f"got {self.max_tool_calling_iterations}")
        if self.neftune_noise_alpha is not None and not self.neftune_noise_alpha >= 0:
            raise UserError(f"{where}.neftune_noise_alpha: must be >= 0 or null, got {self.neftune_noise_alpha}")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise UserError(f"{where}.router_aux_loss_coef: must be >= 0 or null, got {self.router_aux_loss_coef}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise UserError(f"{where}.epsilon_high: must be >= 0, got {self.epsilon_high}")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and lo < 0:
            raise UserError(f"{where}.vllm_importance_sampling_clip_min: must be >= 0 or null, got {lo}")
        if hi is not None and hi <= 0:
            raise UserError(f"{where}.vllm_importance_sampling_clip_max: must be > 0 or null, got {hi}")
        if lo is not None and hi is not None and lo >= hi:
            raise UserError(f"{where}.vllm_importance_sampling_clip_min: must be below clip_max ({hi}), got {lo}")
        if self.vllm_importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise UserError(f"{where}.vllm_importance_sampling_mode: {self.vllm_importance_sampling_mode} needs "
                            f"vllm_importance_sampling_clip_min or _clip_max")
        if not 0 < self.top_p <= 1:
            raise UserError(f"{where}.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise UserError(f"{where}.max_steps: must be > 0, or -1 for num_train_epochs, got {self.max_steps}")
        if self.max_steps == -1 and self.num_train_epochs <= 0:
            raise UserError(f"{where}.num_train_epochs: must be > 0 when max_steps is -1, got {self.num_train_epochs}")
        if self.eval_steps is not None and (self.eval_steps <= 0 or (self.eval_steps >= 1 and not float(self.eval_steps).is_integer())):
            raise UserError(f"{where}.eval_steps: must be a whole number of steps or a fraction in (0, 1), "
                            f"got {self.eval_steps}")
        if self.per_device_eval_batch_size < 1:
            raise UserError(f"{where}.per_device_eval_batch_size: must be at least 1, got {self.per_device_eval_batch_size}")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise UserError(f"{where}.num_generations_eval: must be at least 1, got {self.num_generations_eval}")
        if self.warmup_steps < 0 or (self.warmup_steps >= 1 and not float(self.warmup_steps).is_integer()):
            raise UserError(f"{where}.warmup_steps: must be a whole number of steps or a fraction in [0, 1), "
                            f"got {self.warmup_steps}")
        if self.loss_type not in LOSS_TYPES:
            from hpcrl.job.config import closest
            raise UserError(f"{where}.loss_type: {self.loss_type!r} is not one of "
                            f"{', '.join(LOSS_TYPES)}{closest(self.loss_type, LOSS_TYPES)}")
        self._validate_more(where)

    def _validate_more(self, where: str) -> None:
        if self.optim in BNB_8BIT_ADAMW:
            raise UserError(f"{where}.optim: {self.optim!r} is bitsandbytes' 8-bit AdamW, whose kernels do not take "
                            f"FSDP2's sharded parameters; adamw_torch_8bit keeps the Adam moments in 8 bits too "
                            f"(torchao's)")
        if self.optim not in OPTIMS:
            raise UserError(f"{where}.optim: {self.optim!r} is not supported; hpcrl's optimizer is AdamW: "
                            f"one of {', '.join(OPTIMS)}")
        self._validate_scheduler(where)
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise UserError(f"{where}.min_p: must be in [0, 1] or null, got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise UserError(f"{where}.repetition_penalty: must be > 0, got {self.repetition_penalty}")
        if self.delta is not None and self.delta <= 0:     # TRL recommends above 1 + epsilon
            raise UserError(f"{where}.delta: must be > 0 or null, got {self.delta}")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise UserError(f"{where}.off_policy_mask_threshold: must be >= 0 or null, "
                            f"got {self.off_policy_mask_threshold}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise UserError(f"{where}.{name}: must be > 0, got {getattr(self, name)}")
        if not 0 < self.ref_model_mixup_alpha <= 1:
            raise UserError(f"{where}.ref_model_mixup_alpha: must be in (0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            raise UserError(f"{where}.ref_model_sync_steps: must be at least 1, got {self.ref_model_sync_steps}")
        if self.sync_ref_model and self.beta == 0:
            raise UserError(f"{where}.sync_ref_model: needs beta > 0 (with beta 0 there is no reference model)")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise UserError(f"{where}.save_total_limit: must be at least 1 or null, got {self.save_total_limit}")
        if self.use_adaptive_entropy and not 0 <= self.entropy_coef_min <= self.entropy_coef_max:
            raise UserError(f"{where}.entropy_coef_min: the adaptive coefficient's bounds need 0 <= entropy_coef_min "
                            f"<= entropy_coef_max, got {self.entropy_coef_min} and {self.entropy_coef_max}")
        if self.use_adaptive_entropy and self.entropy_coef_delta <= 0:
            raise UserError(f"{where}.entropy_coef_delta: the adaptive coefficient's step must be positive, "
                            f"got {self.entropy_coef_delta}")
        if self.vllm_structured_outputs_regex is not None:
            try:
                re.compile(self.vllm_structured_outputs_regex)
            except re.error as e:
                raise UserError(f"{where}.vllm_structured_outputs_regex: {self.vllm_structured_outputs_regex!r} is not "
                                f"a regular expression: {e}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise UserError(f"{where}.top_entropy_quantile: must be in (0, 1], got {self.top_entropy_quantile}")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise UserError(f"{where}.generation_batch_size: give it or steps_per_generation, not both (as TRL)")
        for name in ("steps_per_generation", "generation_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"{where}.{name}: must be at least 1, got {getattr(self, name)}")
        if self.steps_per_generation and self.steps_per_generation % self.gradient_accumulation_steps:
            raise UserError(f"{where}.steps_per_generation: {self.steps_per_generation} is not a multiple of "
                            f"gradient_accumulation_steps ({self.gradient_accumulation_steps}); hpcrl trains a "
                            f"whole number of optimizer steps on each generation")

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):
            object.__setattr__(self, "scale_rewards", "group" if self.scale_rewards else "none")

    def _validate_scheduler(self, where: str) -> None:
        name, kwargs = self.lr_scheduler_type, dict(self.lr_scheduler_kwargs or {})
        if name in SCHEDULERS_ON_METRICS:
            raise UserError(f"{where}.lr_scheduler_type: {name!r} steps on an evaluation metric, which hpcrl does "
                            f"not feed to schedules yet; use one that steps per optimizer step: "
                            f"{', '.join(SCHEDULER_KWARGS)}")
        if name not in SCHEDULER_KWARGS:
            raise UserError(f"{where}.lr_scheduler_type: {name!r} is not one of {', '.join(SCHEDULER_KWARGS)}"
                            f"{closest(name, SCHEDULER_KWARGS)}")
        allowed = SCHEDULER_KWARGS[name]
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            takes = f"takes only {', '.join(allowed)}" if allowed else "takes none"
            raise UserError(f"{where}.lr_scheduler_kwargs: {', '.join(unknown)} not taken by lr_scheduler_type "
                            f"{name!r} ({takes})")
        missing = [k for k in SCHEDULER_REQUIRED.get(name, ()) if k not in kwargs]
        if missing:
            raise UserError(f"{where}.lr_scheduler_kwargs: lr_scheduler_type {name!r} needs {', '.join(missing)}")
        if name.startswith("cosine") and name.endswith("min_lr") and ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
            raise UserError(f"{where}.lr_scheduler_kwargs: lr_scheduler_type {name!r} needs one of min_lr and "
                            f"min_lr_rate (open-r1's recipes: min_lr_rate: 0.1)")
        if name == "polynomial" and float(kwargs.get("lr_end", 1e-7)) >= self.learning_rate:
            raise UserError(f"{where}.lr_scheduler_kwargs: polynomial's lr_end ({kwargs.get('lr_end', 1e-7)}) must be "
                            f"below learning_rate ({self.learning_rate})")

    @property
    def completions_per_trainer_step(self) -> int:
        """Completions one trainer trains on per optimizer step: gradient_accumulation_steps
        micro-batches of per_device_train_batch_size each."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def micro_batches_per_generation(self, num_trainers: int) -> int:
        """TRL's steps_per_generation: micro-batches of per_device_train_batch_size completions one
        generation holds per trainer (compose checks that generation_batch_size divides evenly)."""
        if self.steps_per_generation:
            return self.steps_per_generation
        if self.generation_batch_size:
            return self.generation_batch_size // (self.per_device_train_batch_size * num_trainers)
        return self.gradient_accumulation_steps

    def optimizer_steps_per_generation(self, num_trainers: int) -> int:
        """Optimizer steps trained on one generation: its slices, num_iterations times over."""
        return self.num_iterations * self.micro_batches_per_generation(num_trainers) // self.gradient_accumulation_steps


# The built-in demo task's values, tuned on the warmed-up "demo:tiny" model: its demo_correct reward
# rises from ~0.6 to ~0.87 in 200 steps, about a minute and a half on two CPU cores. They are the
# defaults of a recipe whose data is the demo task (hpcrl.login.compose); every other recipe starts
# from TRL's.
DEMO_GRPO = {
    "learning_rate": 5e-4,
    "per_device_train_batch_size": 128,     # 32 prompts x 4
    "num_generations": 4,
    "max_completion_length": 16,
    "vllm_importance_sampling_correction": False,
    "max_steps": 200,
    "lr_scheduler_type": "constant",
    "seed": 0,
    "gradient_checkpointing": False,
    "save_steps": 0,
}
