"""The ``hpcrl_shm`` backend's part of ``TrainerWeightSync`` (trainer.py): the gathers on every
trainer rank of the node and, on the sender, the hand-off to the node's server through a
``shm.ShmWeightSender`` (the region, its slots and signals: shm.py)."""

from __future__ import annotations

import torch

from hpcrl.compute.sync.api import SenderSetup
from hpcrl.compute.sync.gather import bucket_groups, gather_and_drop, gather_into, iter_buckets, param_specs
from hpcrl.compute.sync.layout import CheckpointLayout
from hpcrl.compute.sync.shm import SendStats, ShmWeightSender

__all__ = ["ShmTransport"]


class ShmTransport:
    """``hpcrl_shm`` inside ``TrainerWeightSync``: every rank gathers the buckets in the agreed
    ``setup.wire_dtype``, the sender hands them to the server through a ``ShmWeightSender`` (built
    here, so the region is sized for the largest tensor in that dtype).

    Where the model's checkpoint layout is its memory's (every dense model), the sender gathers
    each bucket straight into its shared-memory slot (``gather.gather_into``): the all-gather
    writes the full tensor there, and no gathered copy is allocated, faulted in and copied again.
    A layout that converts tensors (fused MoE experts) gathers, converts, and copies."""

    def __init__(self, setup: SenderSetup) -> None:
        self.params, self.client, self.is_sender = setup.params, setup.client, setup.is_sender
        self.bucket_bytes, self.tracker, self.traffic = setup.bucket_bytes, setup.tracker, setup.traffic
        self.wire_dtype = setup.wire_dtype
        self.sender: ShmWeightSender | None = None
        # vLLM loads checkpoint names (per-expert MoE weights, not transformers' fused ones).
        self.layout = CheckpointLayout(setup.model, self.params)
        if self.is_sender:
            largest = max((s.nbytes for s in self.layout.specs(param_specs(self.params, self.wire_dtype))), default=0)
            shm = setup.options
            self.sender = ShmWeightSender(self.client, self.bucket_bytes, largest, shm_dir=shm.shm_dir,
                                          job_token=shm.job_token, mode=shm.mode, stall_timeout_s=shm.stall_timeout_s)

    def send(self, version: str) -> tuple[SendStats | None, Exception | None]:
        if self.traffic is not None:
            self.traffic.reset()
        if self.layout.identity:
            return self._send_in_place(version)
        buckets = iter_buckets(self.params, self.bucket_bytes, keep=self.is_sender, cast_to=self.wire_dtype,
                               tracker=self.tracker, traffic=self.traffic)
        try:
            if self.is_sender:
                self.client.pending_version = version
                return self.sender.send(self.layout.buckets(buckets), version), None
            return None, None
        except Exception as exc:
            return None, exc
        finally:
            for _ in buckets:  # finish the gathers: the other ranks are still in them
                pass

    def _send_in_place(self, version: str) -> tuple[SendStats | None, Exception | None]:
        """The sync with each bucket gathered into its slot; the other ranks gather into scratch."""
        gather = dict(cast_to=self.wire_dtype, tracker=self.tracker, traffic=self.traffic)
        if not self.is_sender:
            gather_and_drop(self.params, **gather)
            return None, None
        wire = self.wire_dtype
        in_slot = {s.name: (s.name, s.dtype, s.shape) for s in param_specs(self.params, wire)}
        groups = [chunk for group in bucket_groups(self.params, self.bucket_bytes, wire)
                  for chunk in self.sender.chunks(group, spec=lambda item: in_slot[item[0]])]
        gathered = 0    # groups whose collectives ran

        def gather_group(i: int, views: list[torch.Tensor]) -> None:
            nonlocal gathered
            for (_, param), view in zip(groups[i], views):
                gather_into(param, view, **gather)
            gathered = i + 1

        try:
            self.client.pending_version = version
            specs = [[in_slot[name] for name, _ in group] for group in groups]
            return self.sender.send_gathering(specs, gather_group, version), None
        except Exception as exc:
            return None, exc
        finally:
            # finish the gathers: the other ranks are still in them
            gather_and_drop([item for group in groups[gathered:] for item in group], **gather)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

