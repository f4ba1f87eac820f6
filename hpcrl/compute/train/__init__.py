"""Compute-side training code: GRPO math, prompt data, reward functions."""
