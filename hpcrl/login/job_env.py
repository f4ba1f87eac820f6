"""The job's environment, as the sbatch script exports it: what hpcrl derives from the site's fields
(NCCL's fabric, the GPUs' order, HF_HOME, the kernel cache's variables) with the site's [env] over it,
and the site's "auto" paths made concrete at compose time, on the login node.

  CUDA_DEVICE_ORDER=PCI_BUS_ID   on NVIDIA sites: CUDA numbers GPUs fastest first by default, while
                                 node.gpu_cores, nvidia-smi and Slurm's gres follow the PCI order
  NCCL_SOCKET_IFNAME, NCCL_IB_HCA  site.nccl.socket_ifname, site.nccl.ib_hca, when set
  HF_HOME (HF_HUB_CACHE)         site.hf_home: never under $HOME; "auto" keeps the hub cache the login
                                 node checked the recipe's hub ids in
  TRITON_CACHE_DIR, VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR (MIOPEN_USER_DB_PATH,
  MIOPEN_CUSTOM_CACHE_DIR on AMD)  site.stage.kernel_cache: the node-local copy of the persistent
                                 kernel cache the script stages before the run and saves after it

[env] wins over the first three (a site that already sets NCCL_SOCKET_IFNAME there keeps it); the
kernel cache's variables win over [env]'s (setting stage.kernel_cache is asking for them). Values
are unexpanded: the script quotes them (plain $VARIABLES expand in the job's shell, nothing else).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from hpcrl.job import hfcache
from hpcrl.job.errors import UserError
from hpcrl.job.site import Site
from hpcrl.job.spec import JobSpec

AUTO = "auto"
# Beside the run directory, in the runs directory: on the file system compute nodes write, shared
# by the user's runs there.
HF_HOME_NAME = ".hf-home"
KERNEL_CACHE_NAME = ".kernel-cache"


def kernel_cache_env(site: Site) -> dict[str, str]:
    """The kernel caches' variables, pointing into the node-local copy (stage.kernel_cache_dest)."""
    if not site.stage.kernel_cache:
        return {}
    dest = site.stage.kernel_cache_dest.rstrip("/")
    env = {"TRITON_CACHE_DIR": f"{dest}/triton", "VLLM_CACHE_ROOT": f"{dest}/vllm",
           "TORCHINDUCTOR_CACHE_DIR": f"{dest}/inductor"}
    if site.gpu_vendor == "amd":
        env.update(MIOPEN_USER_DB_PATH=f"{dest}/miopen", MIOPEN_CUSTOM_CACHE_DIR=f"{dest}/miopen")
    return env


def environment(spec: JobSpec) -> dict[str, str]:
    """Every variable the job's tasks get from hpcrl, in the order the script exports them."""
    site = spec.site
    env: dict[str, str] = {}
    if site.gpu_vendor == "nvidia":
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if site.nccl.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = site.nccl.socket_ifname
    if site.nccl.ib_hca:
        env["NCCL_IB_HCA"] = site.nccl.ib_hca
    if site.hf_home and site.hf_home != AUTO:       # "auto" is made a path at compose (no run directory: none)
        env["HF_HOME"] = site.hf_home
    kernels = kernel_cache_env(site) if site.scheduler == "slurm" else {}    # only the batch script stages it
    env.update((key, value) for key, value in spec.environment().items() if key not in kernels)
    env.update(kernels)
    return env


def staged_kernel_cache(spec: JobSpec) -> dict[str, str] | None:
    """What the script's kernel-cache steps need: the persistent cache and its node-local copy."""
    stage = spec.site.stage
    if not stage.kernel_cache or stage.kernel_cache == AUTO:
        return None
    return {"source": stage.kernel_cache, "dest": stage.kernel_cache_dest.rstrip("/")}


def resolve(site: Site, run_dir: Path, environ: Mapping[str, str] | None = None) -> Site:
    """`site` with its "auto" paths (hf_home, stage.kernel_cache) made concrete for a job whose run
    directory is `run_dir`; job.json keeps them, so a resubmission runs with the same ones."""
    environ = os.environ if environ is None else environ
    if site.stage.kernel_cache == AUTO:
        site = replace(site, stage=replace(site.stage, kernel_cache=str(run_dir.parent / KERNEL_CACHE_NAME)))
    if site.hf_home == AUTO:
        if "HF_HOME" in site.env:        # the site's [env] names it: that one
            site = replace(site, hf_home="")
        else:
            home = _auto_hf_home(run_dir, environ)
            # The hub's files stay where the login node looked for the recipe's hub ids (compute
            # nodes are offline): only what the job writes (datasets' prepared data) moves.
            hub, _ = hfcache.hub_cache_dirs(environ)
            extra = {} if "HF_HUB_CACHE" in site.env or Path(hub) == Path(home) / "hub" else {"HF_HUB_CACHE": str(hub)}
            site = replace(site, hf_home=home, env={**extra, **site.env})
    return site


def _auto_hf_home(run_dir: Path, environ: Mapping[str, str]) -> str:
    home = Path(environ.get("HOME") or os.path.expanduser("~"))
    mine = environ.get("HF_HOME", "")
    if mine and posixpath.isabs(mine) and not _under(Path(mine), home):
        return mine
    beside = run_dir.parent / HF_HOME_NAME
    if not _under(beside, home):
        return str(beside)
    raise UserError(f"site.hf_home: \"auto\" found no place outside $HOME ({home}) for the job's Hugging Face "
                    f"caches: $HF_HOME is {'unset' if not mine else mine} and the run directory {run_dir} is under "
                    f"$HOME; set site.hf_home to a directory on the shared or scratch file system (or pass "
                    f"--run-dir there)")


def _under(path: Path, top: Path) -> bool:
    try:
        path, top = path.resolve(), top.resolve()
    except OSError:
        pass
    return path == top or top in path.parents


def hf_variables(site: Site) -> dict[str, str]:
    """The HF_HOME the job gets from site.hf_home, for the login node's check of the recipe's hub ids
    (hpcrl.login.inputs); "auto", before the run directory is known, as a variable (not looked at)."""
    if not site.hf_home or "HF_HOME" in site.env:
        return {}
    return {"HF_HOME": f"$HPCRL_RUN_DIR/../{HF_HOME_NAME}" if site.hf_home == AUTO else site.hf_home}


def kept_hub_cache(site: Site) -> dict[str, str]:
    """site.hf_home "auto" keeps the hub cache of this environment (resolve exports it as HF_HUB_CACHE):
    the check looks for hub ids there, as it does without hf_home."""
    if site.hf_home != AUTO or "HF_HOME" in site.env or "HF_HUB_CACHE" in site.env:
        return {}
    hub, _ = hfcache.hub_cache_dirs(os.environ)
    return {"HF_HUB_CACHE": str(hub)}
