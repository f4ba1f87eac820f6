"""Pin a task to the GPU(s) and CPU cores its plan row names, before torch is imported.

srun gives every task all of the node's GPUs (the site profiles ask for --gpu-bind=none); hpcrl
narrows each task down itself, so the placement `hpcrl plan` prints is exactly what runs, on
every site, whatever srun's binding options do there.

GPU ids in the plan are the node's physical ids; the visibility variable the launcher set (if
any) lists the devices the job holds, and plan GPU g is its g-th entry. On ROCm one variable
is set (ROCR_VISIBLE_DEVICES, the runtime-level mask) and the HIP/CUDA ones are removed:
they would apply on top of it, relative to the already-masked list ("invalid device ordinal");
an inference server also gets HIP_VISIBLE_DEVICES=0..k-1, relative to its mask, for Ray's sake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping

from hpcrl.job.placement import Task, format_cores
from hpcrl.job.site import Site, parse_cpu_list

GPU_VARS = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}
# Removed once the vendor's variable is set. On ROCm the HIP/CUDA ones would index into the
# ROCr mask; elsewhere the other vendor's (Slurm sets them all) would only contradict it.
_CONFLICTING = {"amd": ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL"),
                "nvidia": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")}


class PinningError(RuntimeError):
    """The plan asks for GPUs or cores this node does not give the task."""


@dataclass(frozen=True)
class Pinning:
    gpu_env: dict[str, str] = field(default_factory=dict)    # variables set
    gpu_env_removed: tuple[str, ...] = ()
    cores: tuple[int, ...] = ()                              # the affinity applied
    dropped_cores: tuple[int, ...] = ()                      # planned, but not allowed to this task
    warning: str = ""                                        # why the cores are not the planned ones


def inherited_devices(site: Site, environ: Mapping[str, str]) -> list[str] | None:
    """The devices the launcher handed to the task, in order; None when it set nothing."""
    names = ["ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"] \
        if site.gpu_vendor == "amd" else ["CUDA_VISIBLE_DEVICES"]
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() not in ("", "NoDevFiles"):
            return [v.strip() for v in value.split(",")]
    return None


def gpu_environment(site: Site, task: Task, environ: Mapping[str, str]) -> tuple[dict[str, str], tuple[str, ...]]:
    """(variables to set, variables to remove) that make exactly `task.gpus` visible."""
    var = GPU_VARS.get(site.gpu_vendor)
    if var is None:
        return {}, ()
    held = inherited_devices(site, environ)
    if held is None:
        ids = [str(g) for g in task.gpus]
    else:
        if len(held) < site.node.gpus:
            raise PinningError(
                f"the launcher gave rank {task.rank} GPU(s) {','.join(held)} but site {site.name} has "
                f"{site.node.gpus} per node; hpcrl pins GPUs itself, so srun must give every task all of "
                f"the node's GPUs (--gpu-bind=none, no --gpus-per-task)")
        ids = [held[g] for g in task.gpus]
    set_vars = {var: ",".join(ids)}
    if site.gpu_vendor == "amd" and task.role == "server":
        # Indices into the ROCr mask, so both name the same devices. Ray, which vLLM starts for an
        # engine over several GPUs (ROCm builds ship it), refuses ROCR_VISIBLE_DEVICES without
        # HIP_VISIBLE_DEVICES ("Please use HIP_VISIBLE_DEVICES instead"): every engine with
        # tensor_parallel_size >= 2 died at start. vLLM copies it to CUDA_VISIBLE_DEVICES itself.
        set_vars["HIP_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(ids)))
    remove = tuple(v for v in _CONFLICTING[site.gpu_vendor] if v in environ and v not in set_vars)
    return set_vars, remove


def online_cores() -> set[int]:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return set(parse_cpu_list(f.read().strip(), "/sys/devices/system/cpu/online"))
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def cpu_set(site: Site, task: Task, allowed: set[int], existing: set[int],
            tasks_per_node: int) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(cores to pin to, planned cores dropped because this task may not use them, a warning when
    the planned cores could not be used at all)."""
    planned = set(task.cores)
    absent = sorted(planned - existing)
    if absent:
        raise PinningError(
            f"site {site.name} puts rank {task.rank} (GPU {','.join(map(str, task.gpus))}) on core(s) "
            f"{format_cores(tuple(absent))}, which this node does not have (it has "
            f"{format_cores(tuple(sorted(existing)))}); fix node.gpu_cores / node.cores in the site profile")
    usable = tuple(sorted(planned & allowed))
    if usable:
        return usable, tuple(sorted(planned - allowed)), ""
    # The job's cpuset on this node misses the planned cores: a shared (non-exclusive) node, or SMT
    # siblings counted as CPUs. Running beats aborting; the tasks of the node share what they got.
    share = even_share(sorted(allowed), task.local_rank, tasks_per_node)
    warning = (f"rank {task.rank} is planned on core(s) {format_cores(task.cores)}, but this job may only use "
               f"{format_cores(tuple(sorted(allowed)))} on {site.name}'s node (a node shared with other jobs, "
               f"or SMT siblings); pinned to {format_cores(share)}, an even share of those, instead. Ask for "
               f"whole nodes (--exclusive) or fix node.gpu_cores in the site profile")
    return share, tuple(sorted(planned)), warning


def even_share(cores: list[int], local_rank: int, tasks_per_node: int) -> tuple[int, ...]:
    """Local rank i's slice of `cores` split evenly over the node's tasks (one core, shared, when
    there are fewer cores than tasks)."""
    n = max(1, tasks_per_node)
    if len(cores) < n:
        return (cores[local_rank % len(cores)],)
    return tuple(cores[local_rank * len(cores) // n:(local_rank + 1) * len(cores) // n])


def resolve(site: Site, task: Task, tasks_per_node: int, environ: Mapping[str, str] = os.environ) -> Pinning:
    """What pinning `task` means on this node; PinningError if the node cannot give it."""
    set_vars, removed = gpu_environment(site, task, environ)
    cores, dropped, warning = cpu_set(site, task, set(os.sched_getaffinity(0)), online_cores(), tasks_per_node)
    return Pinning(set_vars, removed, cores, dropped, warning)


def apply_gpu_env(pinning: Pinning, environ: MutableMapping[str, str] = os.environ) -> None:
    """Before torch is imported: CUDA/HIP read the variables once, at initialization."""
    for name in pinning.gpu_env_removed:
        environ.pop(name, None)
    environ.update(pinning.gpu_env)
    # Thread pools sized at import (OpenMP, MKL) would otherwise size themselves for all cores.
    environ.setdefault("OMP_NUM_THREADS", str(len(pinning.cores)))


def apply_affinity(pinning: Pinning) -> None:
    """Pin every thread of this process (and so whatever it starts later) to the planned cores.
    Called once the launch's imports are done: on a machine with fewer cores than tasks,
    importing torch in tasks that share one core would take turns for nothing."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, pinning.cores)
        except (ProcessLookupError, PermissionError):
            pass                 # a thread that just ended
