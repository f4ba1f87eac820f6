"""The trainer role: the GRPO loop, TRL's math, the trainer engines, checkpoints and the model out.

role.py              the trainer role's entry: the parts built from the job spec, then the loop
trainer.py           the GRPO loop of one rank: generate -> reward -> advantages -> loss -> step -> sync
generation.py        a generation as the loop holds it: asked for, then scored and packed
ahead.py             generations asked for ahead (overlap, max_staleness): their staleness, the drops
rollouts.py          what the loop asks of generation: single-turn completions, or hpcrl.compute.agents' tool rollouts
scoring.py           a rank's share of a generation scored: rewards, advantages, the logged statistics
batch.py             a generation's tensors: packing, and log-probabilities a micro-batch at a time
logprobs.py          per-token log-probabilities and entropies, a chunk of tokens at a time
advantages.py        group-relative advantages from the rewards, as TRL computes them
loss.py              TRL's GRPO loss of one micro-batch (LossConfig) and its off-policy corrections
entropy_control.py   the entropy bonus's coefficient step by step: fixed, or TRL's adaptive control
rank_metrics.py      a rank's partial metrics and their reduction over all trainers
rewards.py           reward functions: TRL's calling convention, loading, scoring, the demo's
reward_model.py      a sequence-classification model as a reward function
evaluation.py        eval_strategy="steps": the eval split generated, scored and averaged
model_options.py     the options that change the policy module itself: dropout off, NEFTune's noise
optim.py             AdamW, the learning-rate schedule and clipping, with TRL's meanings
data.py              prompt datasets, the demo task, the resumable prompt sampler
sources.py           where the model and the prompts come from (a directory, the hub cache, the demo)
engine.py            TrainEngine, the interface of a trainer engine, and the registry of engines by name
fsdp.py              FSDP2: sharding and loading the policy and reference, and Fsdp2Engine
deepspeed_engine.py  DeepSpeed ZeRO-3: loading, training and checkpoints (DeepSpeedEngine)
deepspeed_params.py  ZeRO-3's parameters through hpcrl.compute.partitioned (gather, load)
loading.py           a Hugging Face checkpoint streamed into a partitioned model, for every engine
lora.py              LoRA (model.use_peft): adapters added, switched off, written out
checkpoint.py        training-state checkpoints: the atomic layout, RNG, resume
export.py            the trained model as a Hugging Face directory, from the sharded trainers
export_checkpoint.py the same from a training checkpoint after the fact (`hpcrl export`)
dcp_reader.py        a torch.distributed.checkpoint read in one process; a damaged file named
base_diff.py         whether the written model differs from the one the run started from
"""
