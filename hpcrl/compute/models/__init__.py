"""Locally built models (no hub downloads).

tiny.py   tiny Qwen2-architecture causal LMs and a byte-level BPE tokenizer (the demo, tests, benchmarks)
"""
