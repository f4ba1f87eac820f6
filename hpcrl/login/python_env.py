"""The job's Python environment, packed for the script to stage (site.stage.python_env "auto", or an
empty python_env at site.stage.python_env_from_nodes nodes or more).

Importing torch and vLLM from a shared file system at scale takes minutes (OLCF measured an import at
8 nodes: 2 s from NVMe, 51 s from Lustre, almost 4 min from NFS), so the script copies the
environment to every node's local storage and runs it from there. Where the user gave no tarball,
the login node names one in .python-env beside the run directory (the runs directory, which compute
nodes read and write) after the environment and the state of its packages; the job's batch step
packs it there if no earlier job did (one reader of the shared file system, once per state), and
later jobs reuse it. Packing there, not at submit, keeps `hpcrl submit` quick and writes nothing big
from the login node.

  a virtual environment   a tar of its directory. Its python is a link to the base interpreter, which
                          stays where it is; sys.prefix follows pyvenv.cfg, so the copy imports its
                          packages from node-local storage. Editable installs keep pointing at their
                          source (a few files, on the shared file system). venv-pack does this, and
                          relocates console scripts too, which the job never runs; it is not in this
                          project's wheel mirror, so the tar is written by hand.
  a conda environment     conda-pack (its prefix is written into its files; the script runs the
                          tarball's conda-unpack), when the login node has it on PATH.
  anything else           python_env "auto" refuses it in one line; python_env_from_nodes says in a
                          note that the environment is not staged, and why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

from hpcrl.job.errors import UserError
from hpcrl.job.site import Site

AUTO = "auto"
PACKS_DIR = ".python-env"       # beside the run directory, shared by the user's runs there


def resolve(site: Site, nodes: int, python: str, run_dir: Path, notes: list[str]) -> tuple[Site, str]:
    """`site` with stage.python_env made the tarball the script stages, and the environment to pack
    into it ("" = nothing to pack: a tarball the user gave, or no staging)."""
    wanted, prefix, why_not = _decide(site, nodes, python)
    if not wanted:
        return site, ""
    if prefix is None:
        if site.stage.python_env == AUTO:
            raise UserError(f"site.stage.python_env: \"auto\" packs the job's Python environment, and {why_not}; "
                            f"set it to a packed environment (conda pack -o env.tar.gz), or \"\"")
        notes.append(f"the Python environment is not staged to the nodes' local storage ({_by_count(site, nodes)}): "
                     f"{why_not}; every task imports from where it is")
        return site, ""
    tarball = run_dir.parent / PACKS_DIR / f"{prefix.name.lstrip('.') or 'env'}-{fingerprint(prefix)}.tar"
    return replace(site, stage=replace(site.stage, python_env=str(tarball))), str(prefix)


def staged_name(tarball: str) -> str:
    """The directory of site.stage.dest a tarball is unpacked into, as the script names it: its file
    name up to its last ".tar" (or ".tgz"), so that environments of other packages sit side by side."""
    name = Path(tarball).name
    name = (name[:name.rfind(".tar")] if ".tar" in name else name).removesuffix(".tgz")
    return "env" if name in ("", ".", "..") else name


def staged_python(site: Site) -> str:
    """The interpreter the tasks of a job that stages its environment start."""
    stage = site.stage
    name = staged_name(stage.python_env) if stage.python_env not in ("", AUTO) else "<the pack's name>"
    return f"{stage.dest}/{name}/bin/python"


def describe(site: Site, nodes: int, python: str) -> str:
    """`hpcrl plan`'s line: whether the job stages its environment, from what, and why (not)."""
    stage = site.stage
    wanted, prefix, why_not = _decide(site, nodes, python)
    if stage.python_env and stage.python_env != AUTO:
        return (f"python env: {stage.python_env} unpacked on each node's {stage.dest}/{staged_name(stage.python_env)} "
                f"(site.stage.python_env)")
    if not wanted:
        at = (f"; from {stage.python_env_from_nodes} nodes on, staged (site.stage.python_env_from_nodes)"
              if stage.python_env_from_nodes and site.scheduler == "slurm" else "")
        return f"python env: not staged: every task imports {python}'s packages where they are{at}"
    why = "site.stage.python_env \"auto\"" if stage.python_env == AUTO else _by_count(site, nodes)
    if prefix is None:
        return f"python env: not staged ({why}): {why_not}"
    return (f"python env: {prefix} staged to each node's {stage.dest} ({why}); packed by the first job into "
            f"{PACKS_DIR} beside the run directory, reused until its packages change")


def _decide(site: Site, nodes: int, python: str) -> tuple[bool, Path | None, str]:
    """Whether the job is to stage the environment of `python` by itself; the environment; why not."""
    stage = site.stage
    if site.scheduler != "slurm":
        return False, None, ""           # only the batch script stages; `hpcrl run` imports in place
    if not (stage.python_env == AUTO or (not stage.python_env and 0 < stage.python_env_from_nodes <= nodes)):
        return False, None, ""
    prefix, why_not = environment_of(python)
    if prefix is None and site.container.image and not os.path.isabs(python):
        why_not = f"the tasks run {python} inside {site.container.image}, whose environment is the image's"
    return True, prefix, why_not


def _by_count(site: Site, nodes: int) -> str:
    return f"site.stage.python_env_from_nodes = {site.stage.python_env_from_nodes}, this job has {nodes} nodes"


def environment_of(python: str) -> tuple[Path | None, str]:
    """The environment whose interpreter `python` is, if hpcrl can pack it; else None and why not."""
    if not os.path.isabs(python):
        return None, f"site.python {python!r} is not the path of an environment's interpreter"
    prefix = Path(python).parent.parent          # not resolved: a venv's python is a link out of it
    if (prefix / "pyvenv.cfg").is_file():
        return prefix, ""
    if (prefix / "conda-meta").is_dir():
        if shutil.which("conda-pack"):
            return prefix, ""
        return None, f"{prefix} is a conda environment, and conda-pack is not on PATH (conda install conda-pack)"
    return None, f"{python} is not in a virtual environment (python -m venv) or a conda environment"


def fingerprint(prefix: Path) -> str:
    """Changes when a package of the environment is installed, removed or upgraded: pip and conda
    rewrite the entries of site-packages (each distribution's .dist-info names its version)."""
    digest = hashlib.sha256(str(prefix).encode())
    for site_packages in sorted(prefix.glob("lib/python*/site-packages")):
        for entry in sorted(os.scandir(site_packages), key=lambda e: e.name):
            digest.update(f"{entry.name} {entry.stat(follow_symlinks=False).st_mtime_ns}\n".encode())
    return digest.hexdigest()[:12]


PART = "$HPCRL_ENV_PART"          # where the script has the pack written, before it renames it


def pack_command(prefix: str) -> list[str]:
    """The words that pack the environment at `prefix` (a JobSpec's python_env_source), with PART for
    the file they write; [] for "" (nothing to pack)."""
    if not prefix:
        return []
    if (Path(prefix) / "conda-meta").is_dir():
        conda_pack = shutil.which("conda-pack") or "conda-pack"
        return [conda_pack, "--prefix", prefix, "--format", "tar", "--ignore-editable-packages", "--quiet",
                "--output", PART]
    return ["tar", "-cf", PART, "-C", prefix, "."]
