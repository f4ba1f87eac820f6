"""The job description both sides read: recipe, site, the job spec, placement, run-directory names.

Standard library only, and nothing from hpcrl.login or hpcrl.compute: the login node builds a
JobSpec from these types and writes it to <run_dir>/job.json; every task of the job loads it back.
The layering test (tests/architecture/test_layering.py) holds the wall.

What a user writes is dataclasses (config.py builds them, with field-named errors). What the
estimate, the mesh choice and the signal lead compute is NamedTuples: a login command creates those
classes at import, and in Python 3.11 a frozen dataclass costs ~0.6 ms to create against ~0.08 ms,
which for nine of them was ~5 ms of the ~30 ms `hpcrl render` spent over its import floor.

errors.py      UserError: a user's mistake, one line naming the field
config.py      typed dataclasses from plain mappings (YAML, TOML, JSON), with field-named errors
recipe.py      what a user writes: model, data, rewards, inference, trainer, checkpoint, launch, ...
grpo_config.py the recipe's grpo section: TRL's GRPOConfig names, defaults and checks; the demo's values
agent_config.py  the recipe's agent section: tools and environments as import paths (TRL's GRPOTrainer arguments)
site.py        a site profile as data (finding the TOML files is hpcrl.login.profiles)
spec.py        JobSpec: recipe + site + resources, validated and frozen; to_json / load
placement.py   which task trains or serves, on which GPUs and cores, who sends the weights
model_shape.py a model's shape and parameter count, from config.json and safetensors headers
lora.py        LoRA's targets: which linear layers get adapters, and what they hold
memory.py      the memory formulas: a trainer's and a server rank's bytes per GPU, by part
job_memory.py  those formulas in a job's setting (dtypes, sequence widths, vLLM's defaults), and a task's memory
mesh_choice.py the trainers' mesh (FSDP or HSDP) and what a weight sync moves across nodes
estimate.py    will it fit: the estimate against the GPUs, its verdict and the fixes
batch.py       the global batch, and the sequences one engine generates per step
signal_lead.py how early Slurm's stop signal comes: site.signal's lead, or one from the checkpoint's write and a step
deepspeed.py   trainer.engine=deepspeed: the ZeRO-3 config from the recipe and a user's DeepSpeed/accelerate files
rundir.py      every name inside a run directory, and its atomic creation
atomic.py      atomic_write (a whole-file write a reader never sees half done) and fsync_dir, for both sides
slurm_time.py  Slurm's --time forms and one duration formatter
demo.py        the built-in demo's model names: the one spelling of the "demo:" prefix
process_group.py  kill_group, SIGKILL to a process group (`hpcrl run` and each task's supervisor)
context.py     the context an engine serves a model with, read from the model's files as vLLM derives it
hfcache.py     where the model and data come from: data.path's forms, the Hugging Face cache, hub ids
metric_keys.py the metrics' names (TRL's), as the trainer writes them and every reader reads them
balance.py     the split of a node's GPUs between generation and training, judged from a run's timings
"""
