"""What the server role and the trainers need of an inference engine, and the engines by name.

An engine generates completions of token-id prompts (types.Sampling in, types.Completion out), says
the dtype it computes in (the trainers send weights in it), hands the server the receiver of its
weights (a sync.api.ServerSync) and builds the trainers' side that feeds it, and closes. What tells
one backend from another is said by the engine itself (``per_prompt_sampling``, ``ends_on``,
``own_processes``), so neither the server nor the trainers test an engine's name.

Engines are registered as "module:Class" and imported when chosen: importing vLLM takes seconds,
and a job on the transformers engine must neither pay for it nor need it installed. A third engine
is a module with an ``InferenceEngine`` subclass and a line in ``ENGINES``.
"""

from __future__ import annotations

import importlib
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Sequence

from hpcrl.compute.inference.types import Completion, Sampling
from hpcrl.job.recipe import auto_engines

__all__ = ["ENGINES", "InferenceEngine", "SyncPeer", "engine_class", "chosen_engine"]

# Engine name (inference.engine; the health file's "engine") -> where its class is.
ENGINES: dict[str, str] = {
    "vllm": "hpcrl.compute.inference.vllm_engine:VLLMEngine",
    "transformers": "hpcrl.compute.inference.hf_engine:TransformersEngine",
}

AUTO_FOUND_NONE = {"cuda": "inference.engine: auto found no vLLM in this environment on a GPU site; install "
                           "the site's vLLM build (on Frontier OLCF's ROCm vLLM container) or set "
                           "inference.engine=transformers to generate with the transformers engine on purpose"}

# The sender's conversation with its engine: (message, timeout in seconds) -> reply.
Request = Callable[[dict, float], dict]


@dataclass(frozen=True)
class SyncPeer:
    """What one trainer's side of one sync round is built from (client.ServerGenerator)."""

    ctx: Any                        # the trainer's LaunchContext
    round: int                      # which of plan.sync_rounds
    request: Request | None         # to the engine this trainer feeds in the round; None: it only gathers
    engine_dtype: str | None        # the engines' dtype, from their health replies
    node_of_rank: dict[int, int]    # the plan's node of every trainer rank (the gathers' traffic)

    def wire_dtype(self):
        """The wire dtype of this trainer's side of the sync: the engines' dtype as a torch dtype,
        or None where they named none that torch has (each tensor then goes as stored). Decided
        here for every engine and transport; the sync's trainers agree on it once when it is built
        (sync.gather.agree_wire_dtype), and no transport asks the engine again."""
        import torch        # here, not at the top: choosing an engine must not import torch

        dtype = getattr(torch, self.engine_dtype or "", None)
        return dtype if isinstance(dtype, torch.dtype) else None


class InferenceEngine(ABC):
    """One engine of the server role. ``version`` is the weight version it generates with (the
    server sets it when a sync finishes); completions carry it."""

    name: ClassVar[str]             # its ENGINES name: the health file's "engine", the log lines'
    # Whether one call takes a Sampling per prompt, each prompt's draws decided by its own seed
    # whatever else is in the batch: then the server merges its trainers' requests into one call.
    per_prompt_sampling: ClassVar[bool] = False
    # Whether it runs in processes of its own, which can die apart from the server's (process_ids,
    # death). The class says how it usually runs; an engine may say otherwise once it has started
    # (vLLM on CPU runs in the server's process).
    own_processes: bool = False
    # The stop signals its own processes end on by design: an engine gone after one is the signal's doing.
    ends_on: frozenset[str] = frozenset()

    version: int = 0

    @classmethod
    def missing(cls) -> str | None:
        """Why it cannot run in this environment (what to install, or use instead); None: it can."""
        return None

    @classmethod
    @abstractmethod
    def for_server(cls, ctx, model_dir: str, errors_log=None) -> "InferenceEngine":
        """The engine of the server role ``ctx`` on ``model_dir``, from the recipe. ``errors_log``:
        a file where its own processes may also write their errors (``failure_cause`` reads it)."""

    @classmethod
    @abstractmethod
    def trainer_sync(cls, model, peer: SyncPeer):
        """The trainers' side of its weight receiver (a sync.api.TrainerSync), for ``model``."""

    @classmethod
    def failure_cause(cls, error: BaseException, errors_log=None) -> BaseException:
        """``error``, or the reason it only points at (in ``errors_log``), as an exception."""
        return error

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling | Sequence[Sampling]) -> list[Completion]:
        """``n`` completions of each prompt, grouped by prompt (``prompt_index``: its position here).
        ``sampling``: one for every prompt, or one per prompt (see ``per_prompt_sampling``)."""

    # ---- continuous generation (the server's streams): requests join while others run
    def add(self, requests: Sequence[tuple[Sequence[int], Sampling]]) -> list[str]:
        """Queue ``(prompt ids, sampling)`` requests, one completion each unless ``sampling.n`` says
        otherwise; returns their ids. Here they wait for the next ``step``; an engine that batches
        continuously (vLLM) starts them at once."""
        queue = self.__dict__.setdefault("_stream_queue", [])
        counter = self.__dict__.setdefault("_stream_ids", itertools.count())
        ids = [str(next(counter)) for _ in requests]
        queue += [(i, list(p), s) for i, (p, s) in zip(ids, requests)]
        return ids

    def step(self) -> list[tuple[str, list[Completion]]]:
        """Generate for a while; the requests that finished, with their completions. Here: every
        queued request, generated as one batch (an engine without continuous batching)."""
        queue, self.__dict__["_stream_queue"] = self.__dict__.get("_stream_queue", []), []
        if not queue:
            return []
        out: dict[str, list[Completion]] = {i: [] for i, _, _ in queue}
        for c in self.generate([p for _, p, _ in queue], [s for _, _, s in queue]):
            request = queue[c.prompt_index][0]
            out[request].append(replace(c, prompt_index=0))
        return list(out.items())

    def unfinished(self) -> int:
        """Requests added and not yet returned by ``step``."""
        return len(self.__dict__.get("_stream_queue", []))

    # ---- each token's weight version (inference.weight_update = in_flight: a sync between two steps)
    def pause_for_sync(self) -> None:
        """A sync opens while requests are under way: no step until ``resume_after_sync``. Here
        nothing to do: the engine steps only when the server calls ``step``, and it does not while
        a sync is open; an engine whose core steps by itself stops it."""

    def resume_after_sync(self) -> None:
        """The sync is done (or abandoned): requests under way go on."""

    def note_progress(self, request: str, tokens: int) -> None:
        """``request`` has ``tokens`` tokens now: those since the last note were sampled with the
        weights the engine holds (``version``). An engine that steps token by token calls it for
        every request a step moved on."""
        marks = self.__dict__.setdefault("_version_marks", {}).setdefault(request, [])
        if marks and marks[-1][1] == self.version:
            marks[-1] = (tokens, self.version)
        elif not marks or tokens > marks[-1][0]:
            marks.append((tokens, self.version))

    def stamped(self, request: str, completion: Completion) -> Completion:
        """``completion`` (``request``'s, finished) with the versions its tokens were sampled with."""
        marks = self.__dict__.get("_version_marks", {}).pop(request, [])
        if len({v for _, v in marks}) <= 1:
            return replace(completion, weight_version=marks[0][1]) if marks else completion
        versions, start = [], 0
        for end, version in marks:
            versions += [version] * (end - start)
            start = end
        versions += [marks[-1][1]] * (len(completion.token_ids) - len(versions))
        return replace(completion, weight_version=versions[0], token_versions=tuple(versions[:len(completion.token_ids)]))

    @property
    @abstractmethod
    def dtype(self) -> str | None:
        """The dtype it computes in ("bfloat16"), which the trainers send weights in; None: as they are."""

    @abstractmethod
    def weight_receiver(self):
        """The server side of its weight sync (a sync.api.ServerSync), matching ``trainer_sync``."""

    def process_ids(self) -> list[int]:
        """Its own processes' pids (their children are theirs too)."""
        return []

    def death(self) -> str | None:
        """How one of its own processes ended, if one has."""
        return None

    def close(self) -> None:
        """Stop what it started."""

    def close_before_exit(self) -> None:
        """Stop what would outlive this process (or is not stopped well by its exit); what only
        frees this process's memory may go with it."""
        self.close()


def engine_class(name: str) -> type[InferenceEngine]:
    """The engine registered as ``name``, its module imported now."""
    if name not in ENGINES:
        raise ValueError(f"unknown inference engine {name!r}; choose one of {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def chosen_engine(requested: str, device: str, vllm_for: str = "") -> type[InferenceEngine]:
    """The engine ``inference.engine: requested`` names on a site of ``device``, refused with what
    to do where it cannot run here. ``vllm_for``: the recipe field that only vLLM serves (auto then
    falls back to nothing else)."""
    if requested != "auto":
        cls = engine_class(requested)
        why = cls.missing()
        if why:
            raise RuntimeError(f"inference.engine: {requested} {why}")
        return cls
    if vllm_for:
        cls = engine_class("vllm")
        if cls.missing():
            raise RuntimeError(f"{vllm_for} needs the vLLM engine, and vllm is not installed in this environment "
                               f"(inference.engine: auto would use the transformers engine)")
        return cls
    for name in auto_engines(device):
        cls = engine_class(name)
        if cls.missing() is None:
            return cls
    raise RuntimeError(AUTO_FOUND_NONE.get(device, "inference.engine: auto found no engine that runs here"))
