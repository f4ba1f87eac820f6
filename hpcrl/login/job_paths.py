"""Where the job will look, seen from the login node: its environment (this one with the site's
variables over it), the Hugging Face caches that environment names, and whether a path is one only
compute nodes can see. hpcrl.login.inputs and hpcrl.login.data_inputs check the recipe's files with these.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcrl.job import hfcache
from hpcrl.job.site import Site
from hpcrl.login import job_env


def environment(site: Site) -> dict[str, str | None]:
    """This environment with the site's variables on top, as the job gets it; a site's cache
    variable pointing where this machine cannot look becomes None (not checked)."""
    env: dict[str, str | None] = {**os.environ, **job_env.kept_hub_cache(site)}
    for key, value in {**job_env.hf_variables(site), **site.env}.items():
        expanded = os.path.expandvars(str(value))
        env[key] = expanded
        if key.startswith("HF_") and ("$" in expanded or not Path(expanded).expanduser().exists()):
            env[key] = None
    return env


def caches(env: dict[str, str | None]) -> tuple[Path | None, Path | None]:
    """(hub cache, datasets cache) the job reads; None for one this machine cannot see."""
    unseen = {k for k, v in env.items() if v is None}
    hub, data = hfcache.hub_cache_dirs({k: v for k, v in env.items() if v is not None})
    # HF_HOME unseen: so is every cache under it, unless its own variable names another place.
    hub_unseen = bool(unseen & {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"}) or \
        ("HF_HOME" in unseen and not env.get("HF_HUB_CACHE"))
    data_unseen = "HF_DATASETS_CACHE" in unseen or ("HF_HOME" in unseen and not env.get("HF_DATASETS_CACHE"))
    return (None if hub_unseen else hub), (None if data_unseen else data)


def unseen_here(path: Path) -> bool:
    """A path on a file system this machine does not have (its top directory, /lustre or
    /mnt/bb, is absent here), or with a variable only the job expands: only compute nodes can tell."""
    if "$" in str(path):
        return True
    parts = path.absolute().parts
    return len(parts) > 1 and not Path(parts[0], parts[1]).exists()
