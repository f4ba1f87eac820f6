"""Locally built models (no hub downloads).

tiny.py        tiny Qwen2-architecture causal LMs and a byte-level BPE tokenizer (the demo, tests, benchmarks)
tiny_agent.py  the agent demo's tiny model: a chat template that renders tools, a warm-up on calculator conversations
"""
