"""Finding site profiles: the TOML files, `extends`, user directories, overrides -> a validated Site.

Lookup order for a site name (later wins; a later file is merged over the earlier one, so a
user file may hold only the fields it changes):
  1. the profiles shipped with hpcrl (sites/)
  2. every directory in $HPCRL_SITES_PATH (colon-separated)
  3. ~/.config/hpcrl/sites ($XDG_CONFIG_HOME respected)
A profile may say `extends = "other"` to start from another profile.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from hpcrl.job.atomic import atomic_write
from hpcrl.job.config import build, closest, deep_merge
from hpcrl.job.errors import UserError
from hpcrl.job.site import SAFE_WORD, Site
from hpcrl.login import user_cache

# The shipped profiles sit in the package (a plain directory: importlib.resources would cost
# `hpcrl render` an import it does not need).
PACKAGE_DIR = Path(__file__).parent.parent
# Tables that describe one machine's hardware: an override replaces them whole.
WHOLE_TABLES = ("node.gpu_cores", "node.gpu_links")


def site_dirs() -> list[Path]:
    dirs = [PACKAGE_DIR / "sites"]
    dirs += [Path(p) for p in os.environ.get("HPCRL_SITES_PATH", "").split(":") if p]
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    dirs.append(config_home / "hpcrl" / "sites")
    return dirs


def site_files(name: str) -> list[Path]:
    return [d / f"{name}.toml" for d in site_dirs() if (d / f"{name}.toml").is_file()]


def available() -> list[str]:
    names = {p.stem for d in site_dirs() if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def _read_toml(path: Path) -> dict:
    """The file's mapping, from a JSON copy in the user's cache where one matches the file's path,
    size and modification time: reading it spares `hpcrl render` the import of tomllib (its regexes,
    datetime), ~5 ms of the ~37 it spends past its import floor (issue #29)."""
    cached = _cached_copy(path)
    if cached is not None:
        try:
            with open(cached, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    import tomllib

    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"site file {path}: invalid TOML ({e})") from None
    if cached is not None:
        try:
            atomic_write(cached, json.dumps(data))
        except (OSError, TypeError):     # TypeError: a TOML date or time, which JSON cannot hold
            pass
    return data


def _cached_copy(path: Path) -> str | None:
    directory = user_cache.directory("sites")
    if directory is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    return os.path.join(directory, f"{path.stem}-{key}.json")


def raw_profile(name: str, _seen: tuple[str, ...] = ()) -> dict:
    """The merged, not yet validated mapping of site `name` (following `extends`)."""
    if not SAFE_WORD.match(name) or "/" in name:
        raise UserError(f"--site: {name!r} is not a site name")
    files = site_files(name)
    if not files:
        raise UserError(f"--site: unknown site {name!r}{closest(name, available())}; "
                        f"known: {', '.join(available())}")
    data: dict = {}
    for path in files:
        data = deep_merge(data, _read_toml(path), WHOLE_TABLES)
    parent = data.get("extends")
    if parent:
        if parent in _seen + (name,):
            raise UserError(f"site {name}: extends {parent!r} makes a loop")
        data = deep_merge(raw_profile(parent, _seen + (name,)), data, WHOLE_TABLES)
    data["name"] = name
    return data


def load(name: str, overrides: dict | None = None) -> Site:
    """The validated profile of `name`, with recipe/flag `overrides` (a nested mapping) merged in."""
    data = raw_profile(name)
    if overrides:
        if "setup" in overrides:
            raise UserError("site.setup: shell set-up lines can only come from a site profile file")
        data = deep_merge(data, overrides, WHOLE_TABLES)
    return build(Site, data, "site")
