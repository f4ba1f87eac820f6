"""One module per `hpcrl` subcommand, each with `main(args) -> int` (args: cli.py's parsed arguments).

The CLI imports only the module of the command given, so each command pays only for its own
imports: `hpcrl status` never loads jinja2, YAML or the recipe, `hpcrl --help` none of these.

run.py      a recipe on this machine, without Slurm (the supervisor is hpcrl.login.local)
render.py   the run directory and its standalone sbatch script; nothing submitted
submit.py   render, sbatch, register; `--resume RUN_DIR` submits a run directory again
plan.py     the placement a job gets on a site, one row per task, and its memory per GPU
recipe.py   the recipe a file and key=value overrides resolve to, every field with its value
sites.py    the site profiles found, or one resolved
status.py   every registered job in one table, or one job in detail
logs.py     a job's Slurm output, or following it until the job ends
cancel.py   stop a registered job, its trainers' checkpoint first
plot.py     one PNG of a run's metrics
export.py   a training checkpoint -> a Hugging Face model directory
"""
