"""The job description both sides read: recipe, site, the job spec, placement, run-directory names.

Standard library only, and nothing from hpcrl.login or hpcrl.compute: the login node builds a
JobSpec from these types and writes it to <run_dir>/job.json; every task of the job loads it back.
tests/test_layering.py holds the wall.

errors.py      UserError: a user's mistake, one line naming the field
config.py      typed dataclasses from plain mappings (YAML, TOML, JSON), with field-named errors
recipe.py      what a user writes: model, data, rewards, GRPO (TRL's names), inference, trainer, ...
site.py        a site profile as data (finding the TOML files is hpcrl.login.profiles)
spec.py        JobSpec: recipe + site + resources, validated and frozen; to_json / load
placement.py   which task trains or serves, on which GPUs and cores, who sends the weights
fit.py         will it fit: memory per GPU, and the trainers' mesh
deepspeed.py   trainer.engine=deepspeed: the ZeRO-3 config from the recipe and a user's DeepSpeed/accelerate files
rundir.py      every name inside a run directory, and its atomic creation
slurm_time.py  Slurm's --time forms and one duration formatter
"""
