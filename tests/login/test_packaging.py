"""A wheel built from the repository holds the whole package and finds its site profiles and sbatch template.

hpcrl/sites and hpcrl/templates are symlinks to the top-level sites/ and templates/: an editable install
reads them through the links, so only a built wheel shows whether setuptools packaged what they point to.
The wheel is built with the test interpreter's own pip and setuptools (--no-build-isolation --no-index:
no network), from a copy of the source tree, because an in-tree build leaves build/ behind and reuses its
build/lib, which still holds modules deleted since the last build. It is then installed with
`pip install --target` and run from outside the repository with PYTHONPATH pointing at it; the
assertions check that `hpcrl` came from that install, not from the editable one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

PACKAGES = ["hpcrl", "hpcrl/job", "hpcrl/login", "hpcrl/login/commands", "hpcrl/compute",
            *(f"hpcrl/compute/{sub}" for sub in ("launch", "train", "inference", "sync", "models"))]
# What an in-tree checkout holds besides the source (mirrors .gitignore).
NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache", "runs", ".gl")


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, \
        f"`{' '.join(map(str, cmd))}` failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _sites(src: Path) -> list[str]:
    return sorted(p.stem for p in (src / "sites").glob("*.toml"))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the source copy it was built from: what it is compared with, as others may edit the repo)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-w", tmp / "dist", src])
    wheels = list((tmp / "dist").glob("hpcrl-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], src


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(site directory, a working directory outside the repository, environment for running from the install)."""
    wheel, _ = built
    tmp = tmp_path_factory.mktemp("install")
    site = tmp / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
          "--target", site, wheel])
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1", HPCRL_HOME=str(tmp / "home"),
               XDG_CONFIG_HOME=str(tmp / "xdg"), XDG_CACHE_HOME=str(tmp / "cache"), HPCRL_SITES_PATH="")
    return site, work, env


def test_wheel_holds_every_module_profile_and_template(built):
    wheel, src = built
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f"hpcrl/sites/{s}.toml" for s in _sites(src) if f"hpcrl/sites/{s}.toml" not in names]
    missing += [p for p in ("hpcrl/templates/sbatch.sh.j2",) if p not in names]
    missing += [f"{p}/__init__.py" for p in PACKAGES if f"{p}/__init__.py" not in names]
    source = {str(Path(root, f).relative_to(src)) for root, dirs, files in os.walk(src / "hpcrl")
              for f in files if f.endswith(".py") and "__pycache__" not in root}
    missing += sorted(source - names)
    assert not missing, f"not in {wheel.name}: {missing}"


def test_installed_wheel_is_the_one_imported(installed):
    site, work, env = installed
    r = _run([sys.executable, "-c",
              "import hpcrl, hpcrl.login.cli, hpcrl.login.profiles as p, hpcrl.login.render as r\n"
              "print(hpcrl.__file__, hpcrl.login.cli.__file__, p.site_dirs()[0], r.__file__, sep='\\n')"],
             cwd=work, env=env)
    paths = r.stdout.split()
    assert paths and all(Path(p).is_relative_to(site) for p in paths), \
        f"hpcrl was not imported from the wheel's install at {site}:\n{r.stdout}"


def test_installed_wheel_lists_sites(built, installed):
    site, work, env = installed
    r = _run([sys.executable, "-m", "hpcrl", "sites"], cwd=work, env=env)
    found = {line.split()[0] for line in r.stdout.splitlines()[1:] if line.strip()}
    assert found == set(_sites(built[1])), r.stdout


def test_installed_wheel_renders(installed, tmp_path):
    site, work, env = installed
    run_dir = tmp_path / "r"
    _run([sys.executable, "-m", "hpcrl", "render", "--site", "cuda", "-N", "1", "--run-dir", run_dir],
         cwd=work, env=env)
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1\n" in script and "-m hpcrl.compute.launch" in script
