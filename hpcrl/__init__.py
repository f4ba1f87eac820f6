"""hpcrl: GRPO fine-tuning of LLMs on Slurm supercomputers.

Three wings, each folder saying where its code runs; imports go login -> job <- compute
(tests/architecture/test_layering.py holds the walls):

job/       the job description both sides read (recipe, site, the job spec, placement, run directories)
login/     the login node: the `hpcrl` command, rendering and submitting the sbatch script, status
compute/   inside a job: the launch, the trainers, the inference engines and the weight sync
"""

__version__ = "0.1.0"
