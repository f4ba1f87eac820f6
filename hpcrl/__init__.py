"""hpcrl: GRPO fine-tuning of LLMs on Slurm supercomputers."""

__version__ = "0.1.0"
