"""Weight sync: sharded trainers -> the node's server, in memory, bounded by a bucket.

Every transport has the two shapes of api.py: a trainer side, ``sync(version) -> stats``, built on
every trainer rank of a node (the gathers are collectives; one of them, the sender, talks to the
server), and a server side, ``handle(msg) -> reply``, called from the server role's loop. The
plan (hpcrl.job.placement) picks the sender: the node's trainer whose GPU shares a fast link group
with the server's GPUs, else the one on the highest-numbered trainer GPU.

The modules (import the one you need: this file imports none of them, so importing a light one,
such as api.py, costs neither torch nor vLLM):

- ``api.py``          the two interfaces, ``SyncError``, the backend names and their transports'
                      registry (``TRANSPORTS``), ``default_backend``. Standard library only.
- ``gather.py``       trainer side, any transport: ordered, bucketed ``full_tensor()`` gathers, HF names;
                      each shard cast to the wire dtype before its gather (the engine's dtype: bf16
                      bytes, not fp32 masters), bit-identical to casting after.
- ``layout.py``       ``CheckpointLayout``: in-memory names -> checkpoint names, a bucket at a time
                      (transformers' own reverse conversion: per-expert MoE tensors); the identity,
                      at no cost, for a model without conversions (every dense model).
- ``trainer.py``      ``TrainerWeightSync``: the trainer side of the vLLM backends (the shared part:
                      agreement of the node's trainers on the outcome and on the wire dtype, gather
                      traffic), with the backend's transport picked by name.
- ``notify.py``       ``NotifyClient``: the sender's messages to the server (vLLM's client protocol
                      over the node channel).
- ``receiver.py``     ``WeightReceiver``: the server side of the vLLM backends, and ``llm_dtype``
                      (vLLM's construction arguments for a sync: hpcrl.compute.inference.vllm_engine).
- ``shm.py``          the ``hpcrl_shm`` transport (CPU, one node, tested): a double-buffered
                      /dev/shm region, its sender and its receiving end.
- ``shm_transport.py`` ``ShmTransport``, hpcrl_shm's part of ``TrainerWeightSync`` (the sender
                      all-gathers evenly split tensors straight into the slots).
- ``shm_vllm.py``     ``hpcrl_shm`` inside vLLM's weight-transfer API: the worker engine that applies
                      the slots, and the engine for vLLM's trainer API.
- ``vllm_engines.py`` vLLM's own ``nccl`` (CUDA, and ROCm through RCCL) and ``ipc`` (CUDA IPC,
                      only when the server shares the sender's GPU) engines on the trainer side,
                      their gathers counted like hpcrl_shm's; ipc's buffer holds the largest
                      tensor, and its engine runs with ``vllm_engine.weight_transfer_env("ipc")``. Written
                      against vLLM 0.32's API; the data path is UNTESTED without a GPU.
- ``reload.py``       around vLLM's layerwise reload: abort without meta-device leftovers, the
                      re-pack of a tied lm_head.
- ``vllm_plugin.py``  the ``vllm.general_plugins`` entry point (``register``) and the worker
                      extension (``WorkerSyncExtension``), loaded in every vLLM process.
- ``channel_sync.py`` the transport of the transformers engine: buckets as tensors over the node
                      channel (``ChannelWeightSync``, ``ChannelReceiver``).
"""
