"""Finding site profiles: the TOML files, `extends`, user directories, overrides -> a validated Site.

Lookup order for a site name (later wins; a later file is merged over the earlier one, so a
user file may hold only the fields it changes):
  1. the profiles shipped with hpcrl (sites/)
  2. every directory in $HPCRL_SITES_PATH (colon-separated)
  3. ~/.config/hpcrl/sites ($XDG_CONFIG_HOME respected)
A profile may say `extends = "other"` to start from another profile.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from hpcrl.job.config import build, closest, deep_merge
from hpcrl.job.errors import UserError
from hpcrl.job.site import SAFE_WORD, Site

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
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"site file {path}: invalid TOML ({e})") from None


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
