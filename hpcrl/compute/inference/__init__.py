"""Generation for the trainers: engines (vLLM, transformers), the per-node server role, its client.

- ``types.py``        what a trainer asks for and gets back: ``Sampling``, ``Completion``, ``Generator``, ``Stream``.
- ``engine.py``       ``InferenceEngine`` (what the server and the client need of an engine) and the
                      engines by name (``ENGINES``, imported when chosen; ``chosen_engine``).
- ``vllm_engine.py``  the vLLM engine: its ``vllm.LLM``'s arguments and environment, its errors' log,
                      and the trainers' side of its weight sync (``TrainerWeightSync``).
- ``hf_engine.py``    the transformers engine: the fallback without vLLM; weights over the node channel.
- ``server.py``       the server role: one engine, batching its trainers' requests (streams: continuously),
                      answering syncs.
- ``client.py``       the trainers' side: requests to the node's engines, and each sync round's sender.
"""
