"""Generation for the trainers: engines (vLLM, transformers), the per-node server role, its client."""
