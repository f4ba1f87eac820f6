"""site.container as the sbatch script runs it: the words put right before the program of every srun
step that runs Python (the launch, the packed environment's unpack, the model copy, the /dev/shm
sweep), with the directories the job needs bound at the same path.

  apptainer, singularity  a command:       apptainer exec [--rocm|--nv] --pwd RUN_DIR --bind DIR ... IMAGE
  pyxis                   srun's options:  --container-image=IMAGE --container-mounts=DIR:DIR,...
                                           --container-workdir=RUN_DIR
srun reads its own options up to the program, so one place on the line serves both forms.

Bound besides container.binds: the run directory; the parent of each node-local staging directory
the job uses (stage.dest's with stage.python_env: the tarball lands beside it; stage.model_dest's
when the model is staged: the copy is made beside it, then renamed); stage.kernel_cache_dest with
stage.kernel_cache (the tasks' kernel caches); container.net_plugin_dir. A
directory under another bind is not bound again. Every value is quoted: plain $VARIABLES expand in
the job's shell, nothing else does.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from hpcrl.job.errors import UserError
from hpcrl.job.site import BIND_PATH
from hpcrl.job.spec import JobSpec
from hpcrl.login.shell_words import env_quote, quote

RUN_DIR = "$HPCRL_RUN_DIR"          # the script's variable: the run directory, as it is on every node
# Variables that differ between nodes: the batch shell expands a bind once, for all of them.
NODE_VARIABLES = re.compile(r"\$\{?(SLURMD_NODENAME|SLURM_NODEID|SLURM_TOPOLOGY_ADDR|HOSTNAME)\b")
GPU_FLAGS = {"amd": "--rocm", "nvidia": "--nv"}      # apptainer's: the host's GPU driver libraries inside


@dataclass(frozen=True)
class ContainerLaunch:
    """What the template needs: the words, their form, and a directory to create before a bind."""
    words: str                      # the shell text of the HPCRL_CONTAINER array, every word quoted
    form: str                       # "a command" or "srun options", for the script's comment
    runtime: str
    image: str
    # stage.model_via "srun" makes the model's directory on each node from inside the container:
    # its parent, bound, must exist first ("" = nothing to create).
    model_parent: str = ""


def container_launch(spec: JobSpec) -> ContainerLaunch | None:
    """site.container for the script; None without one. UserError for a bind no script can make."""
    c = spec.site.container
    if not c.image:
        return None
    binds = container_binds(spec)
    if c.srun_options_form:
        words = [quote(f"--container-image={c.image}"),
                 env_quote("--container-mounts=" + ",".join(f"{b}:{b}" for b in binds)),
                 env_quote(f"--container-workdir={RUN_DIR}"), *map(quote, c.options)]
    else:
        site = spec.site
        gpu = [GPU_FLAGS[site.gpu_vendor]] if site.device == "cuda" and site.gpu_vendor in GPU_FLAGS else []
        words = [c.runtime, "exec", *gpu, "--pwd", env_quote(RUN_DIR),
                 *(w for b in binds for w in ("--bind", env_quote(b))), *map(quote, c.options), quote(c.image)]
    parent = _model_parent(spec)
    made = parent if parent in binds and spec.site.stage.model_via == "srun" else ""
    return ContainerLaunch(" ".join(words), "srun options" if c.srun_options_form else "a command", c.runtime, c.image,
                           env_quote(made) if made else "")


def container_binds(spec: JobSpec) -> list[str]:
    """The directories bound into site.container, unexpanded, each once and none under another."""
    site, c = spec.site, spec.site.container
    staged = []
    if site.stage.python_env:
        staged.append(("stage.dest", _parent(site.stage.dest)))
    if _model_parent(spec):
        staged.append(("stage.model_dest", _model_parent(spec)))
    if spec.site.stage.kernel_cache:
        staged.append(("stage.kernel_cache_dest", site.stage.kernel_cache_dest.rstrip("/")))
    for where, path in staged:
        if not BIND_PATH.match(path):
            raise UserError(f"site.{where}: its directory {path!r} cannot be bound into site.container: an absolute "
                            f"path (plain $VARIABLES allowed), without : , quotes, backslashes or spaces")
    wanted = [RUN_DIR, *c.binds, *([c.net_plugin_dir] if c.net_plugin_dir else []), *(p for _, p in staged)]
    binds = [p for i, p in enumerate(wanted)
             if not any(_under(p, q) and (p != q or j < i) for j, q in enumerate(wanted) if j != i)]
    for where, path in staged:
        if path in binds and NODE_VARIABLES.search(path):
            raise UserError(f"site.{where}: its directory {path} names the node, and the script binds one path for "
                            f"every node: add a directory above it to site.container.binds")
    return binds


def _model_parent(spec: JobSpec) -> str:
    """The directory the staged model's copy is made in ("" when the job stages no model)."""
    return _parent(spec.site.stage.model_dest) if spec.model_source else ""


def _parent(path: str) -> str:
    return posixpath.dirname(path.rstrip("/"))


def _under(path: str, other: str) -> bool:
    """`path` is `other` or inside it (as written: the variables are the same words)."""
    return path == other or path.startswith(other.rstrip("/") + "/")
