"""What runs on a login node: the `hpcrl` command and everything behind it.

Never imports hpcrl.compute, torch, vllm or mpi4py (a login node answers in a blink, and has none
of them); reads and writes the job description of hpcrl.job. `hpcrl run` is the one command that
starts the compute side, as a separate mpiexec process.

cli.py         argparse, and the one place where errors become exit codes
compose.py     recipe file + key=value + flags + site -> JobSpec (every check a login node can make)
trl_config.py  a `trl grpo --config` YAML as a recipe: TRL's flat keys -> hpcrl's sections
strict_yaml.py YAML as a recipe's author means it (a key given twice is an error, no YAML 1.1 slips)
inputs.py      the recipe's model, tokenizer and dataset checked before a job waits in a queue; the
               parts a recipe may lack in their own modules, imported only when it has them:
data_inputs.py   the data's files, splits and columns as load_dataset will find them
lora_inputs.py   model.lora_target_modules against the model's modules
job_paths.py   where the job will look: its environment, its Hugging Face caches, paths only nodes see
data_rows.py   every row's prompt checked (an empty one fails here, not on the compute nodes)
agent_inputs.py  the agent section checked: tools' and environments' source (read, not imported), the chat template
deepspeed_inputs.py  trainer.engine=deepspeed: a user's DeepSpeed or accelerate config read and checked
write_dirs.py  the run, checkpoint and output directories: writable from compute nodes, not another run's
profiles.py    finding site profiles: shipped, $HPCRL_SITES_PATH, ~/.config/hpcrl/sites, `extends`
user_cache.py  ~/.cache/hpcrl: what commands keep between them (the compiled template, parsed site files)
commands/      one module per subcommand (run, render, submit, plan, sites, status, logs, cancel,
               plot), each a main(args); cli.py imports only the one given
render.py      JobSpec -> the standalone sbatch script (templates/sbatch.sh.j2)
job_env.py     the job's environment from the site's fields (NCCL's fabric, GPU order, HF_HOME, kernel cache)
python_env.py  the Python environment the job stages at scale (stage.python_env "auto"): which, and the tarball's name
task_packages.py  what the tasks' Python must hold for the recipe (its engine, torchao for 8-bit AdamW)
launch_prefix.py  site.container as the script runs it: apptainer's command or pyxis's srun options, the binds
module_imports.py the recipe's own modules its named ones import (ast), copied with them
shell_words.py the script's quoting: literal words, and words whose plain $VARIABLES expand
slurm.py       the only module that runs Slurm commands; the one list of finished job states
registry.py    the SQLite job registry behind `hpcrl status`
status.py      registry + Slurm + run directory -> what a person sees (shared by status, logs, cancel)
table.py       the one table printer
api.py         the same submit path for notebooks (a submitit job handle)
plot.py        metrics.jsonl -> one PNG
local/         `hpcrl run`: the mpiexec supervisor on this machine (a module per job: mpiexec, supervision,
               console, progress and summary)
"""
