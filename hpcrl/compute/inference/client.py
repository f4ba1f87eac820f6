"""The trainers' side of the node's server: generation requests over the node channel, and the
weight sync (every trainer gathers; the node's sender streams to the server). The sync's
transports are in hpcrl.compute.sync: ``TrainerWeightSync`` for a vLLM server, ``ChannelWeightSync``
for a transformers one."""

from __future__ import annotations

import os
import socket
import time
from typing import Sequence

from hpcrl.compute.inference.types import Completion, Sampling
from hpcrl.compute.launch.context import LaunchContext
from hpcrl.compute.sync.api import TrainerSync, default_backend


class ServerUnavailable(RuntimeError):
    """The node's server did not answer within its bound."""


def generation_timeout_s(inference, prompts: int, sampling: Sampling, trainers: int = 1) -> float:
    """How long a trainer waits for the completions of one generation request: the fixed
    ``inference.request_timeout_s`` plus ``inference.generation_s_per_ktoken`` for every 1,000
    completion tokens asked for (prompts x n x max_tokens). ``trainers``: the node's trainers,
    whose requests the server generates as one batch, so each waits for all of theirs."""
    ktokens = trainers * prompts * sampling.n * sampling.max_tokens / 1000
    return inference.request_timeout_s + inference.generation_s_per_ktoken * ktokens


def transport_options(backend: str, is_sender: bool, server_gpus: int, engine_dtype: str | None = None) -> dict:
    """What TrainerWeightSync needs for `backend` beyond the model and the channel.

    nccl (RCCL on ROCm): the sender hosts the group's rendezvous (a TCPStore) and the server's
    workers join it. Both are on this node, so it listens on loopback, on a port free now (the
    store binds it moments later). The group is the sender plus the server's tensor-parallel
    workers; the node's other trainers only take part in the gathers. Weights travel in the
    engine's dtype (the trainer keeps fp32 masters: half the bytes for a bf16 engine); every
    trainer knows it from the server's health reply, and casts its shards before the gathers.
    ipc: the same dtype; it has no rendezvous. (hpcrl_shm learns the engine's dtype in its own
    handshake, and TrainerWeightSync hands it to the other trainers.)"""
    if backend not in ("nccl", "ipc"):
        return {}
    import torch

    cast_to = getattr(torch, engine_dtype, None) if engine_dtype else None
    options = {"cast_to": cast_to if isinstance(cast_to, torch.dtype) else "auto"}
    if backend == "nccl":
        options.update(nccl_master=("127.0.0.1", _free_port()) if is_sender else None, server_world_size=server_gpus)
    return options


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerGenerator:
    def __init__(self, ctx: LaunchContext, model):
        self.ctx = ctx
        self.model = model
        self.inf = ctx.spec.recipe.inference
        self.channel = ctx.channel
        self.server = ctx.server_task
        self.engine = None              # the server's engine name and dtype, from its first health reply
        self.engine_dtype: str | None = None
        self.sync: TrainerSync | None = None
        self.in_flight: _ServerGeneration | None = None

    def _request(self, msg: dict, timeout: float, setting: str = "inference.request_timeout_s") -> dict:
        # One conversation at a time on the channel: a reply must not be taken for another's.
        assert self.in_flight is None, f"{msg['op']!r} sent while a generation is in flight"
        self.channel.send(msg)
        return self._reply(msg["op"], timeout, setting)

    def _reply(self, op: str, timeout: float, setting: str) -> dict:
        """The server's answer to ``op`` within ``timeout``; ``setting`` says which recipe fields
        set that bound, for the message of a server that stays silent."""
        try:
            return self.channel.recv(timeout=timeout)
        except TimeoutError:
            raise ServerUnavailable(f"the server on node {self.ctx.task.node} (rank {self.server.rank}) did not "
                                    f"answer {op!r} within {timeout:.0f} s ({setting})") from None

    def wait_ready(self) -> None:
        """The server loads its engine while the trainers load the model: wait for it, bounded."""
        t0 = time.perf_counter()
        reply = self._request({"op": "health"}, self.inf.start_timeout_s, "inference.start_timeout_s")
        self.engine, self.engine_dtype = reply["engine"], reply.get("dtype")
        self.ctx.log(f"server on node {self.ctx.task.node} ready ({self.engine}) after "
                     f"{time.perf_counter() - t0:.1f} s of waiting")
        self._make_sync()

    def _make_sync(self) -> None:
        bucket = self.inf.sync_bucket_mb << 20
        if self.engine == "vllm":
            from hpcrl.compute.sync.trainer import TrainerWeightSync

            token = f"{os.environ.get('SLURM_JOB_ID', 'local')}-n{self.ctx.task.node}-{os.getpid()}"
            node_of_rank = {t.trainer_rank: t.node for t in self.ctx.plan.tasks if t.trainer_rank is not None}
            backend = default_backend(self.ctx.device)
            self.sync = TrainerWeightSync(self.model, self._notify if self.ctx.is_sender else None,
                                          is_sender=self.ctx.is_sender, backend=backend, bucket_bytes=bucket,
                                          job_token=token, node_of_rank=node_of_rank,
                                          stall_timeout_s=self.inf.request_timeout_s, log=self.ctx.log,
                                          **transport_options(backend, self.ctx.is_sender, self.inf.gpus,
                                                              self.engine_dtype))
        else:
            import torch

            from hpcrl.compute.sync.channel import ChannelWeightSync

            cast_to = getattr(torch, self.engine_dtype or "", None)
            self.sync = ChannelWeightSync(self.model, self._request, is_sender=self.ctx.is_sender,
                                          bucket_bytes=bucket, timeout_s=self.inf.request_timeout_s,
                                          cast_to=cast_to if isinstance(cast_to, torch.dtype) else None)

    def _notify(self, msg: dict) -> dict:
        """The sync's messages to the server (vLLM's engines call this from their own threads)."""
        return self._request(msg, self.inf.request_timeout_s)

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> "_ServerGeneration":
        """Ask the server for completions and return at once; `result()` takes them."""
        assert self.in_flight is None, "a second generation submitted before the first was taken"
        self.channel.send({"op": "generate", "prompts": [list(p) for p in prompts], "sampling": sampling})
        timeout = generation_timeout_s(self.inf, len(prompts), sampling, max(1, len(self.ctx.node_trainers)))
        self.in_flight = _ServerGeneration(self, timeout)
        return self.in_flight

    def push_weights(self, model, version: int) -> dict:
        # The sender's sync messages share the channel with generation: none may be in flight.
        assert self.in_flight is None, "weights pushed while a generation is in flight"
        self.sync.sync(version)
        return dict(self.sync.last_traffic)

    def close(self) -> None:
        try:
            self.channel.send({"op": "done"})
        except Exception:
            pass
        if self.sync is not None:
            self.sync.close()


class _ServerGeneration:
    """A generate request on the channel whose reply has not been read yet."""

    def __init__(self, client: ServerGenerator, timeout_s: float):
        self.client = client
        self.timeout_s = timeout_s
        self.completions: list[Completion] | None = None

    def result(self) -> list[Completion]:
        if self.completions is None:
            c = self.client
            reply = c._reply("generate", self.timeout_s, f"inference.request_timeout_s={c.inf.request_timeout_s:g} + "
                             f"inference.generation_s_per_ktoken={c.inf.generation_s_per_ktoken:g} per 1,000 "
                             f"completion tokens requested")
            c.in_flight = None
            if not reply.get("ok"):
                raise RuntimeError(f"server on node {c.ctx.task.node} refused to generate: {reply.get('error')}")
            self.completions = reply["completions"]
        return self.completions

