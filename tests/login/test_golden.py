"""Golden sbatch scripts: `hpcrl render` of every shipped Slurm site (and of a few VARIANTS of one), with
fixed arguments, compared line by line with tests/golden/<site>.sbatch, so any change to a site profile or to templates/sbatch.sh.j2 shows up
in review as a diff of the script a user would submit.

What differs between machines and runs is replaced before comparing:
  @RUN_DIR@   the run directory (a pytest temporary directory)
  @RUNS_DIR@  its parent, where site "auto" paths go (hf_home, stage.kernel_cache)
  @PYTHON@    the interpreter running hpcrl (sys.executable), for sites with python = "auto"
  @VERSION@   the hpcrl version in the "Rendered by hpcrl ..." comment

After an intended change, regenerate the files and review their diff:

    HPCRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/login/test_golden.py
    git diff tests/golden/
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, TESTS

GOLDEN = TESTS / "golden"
UPDATE = os.environ.get("HPCRL_UPDATE_GOLDEN") == "1"
REGENERATE = "HPCRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/login/test_golden.py"
FIXED_ARGS = ["-N", "2", "-t", "01:00:00"]
GOLDEN_HUB_CACHE = "/shared/hf/hub"
ACCOUNT = "abc123"
# A shipped site with fields a user sets that change the script's shape, each with its own golden file
# <name>.sbatch: site.container in its two forms (issue #27, item 4), a command before each Python step
# (apptainer, with a staged environment: its unpack runs inside too) and srun options (pyxis).
VARIANTS = {
    "frontier-apptainer": ("frontier", ["site.container.image=/lustre/orion/abc123/vllm-rocm.sif",
                                        "site.python=python3", "site.stage.python_env=/lustre/orion/abc123/env.tar.gz"]),
    "cuda-pyxis": ("cuda", ["site.container.image=nvcr.io#nvidia/pytorch:25.01-py3", "site.python=python3",
                            "site.container.binds=[/scratch]"]),
}


def _profile(name: str) -> dict:
    """A shipped profile's fields, its shipped `extends` chain merged in at the top level (enough to
    read scheduler and account_required)."""
    data = tomllib.loads((REPO / "sites" / f"{name}.toml").read_text())
    parent = data.get("extends")
    return {**_profile(parent), **data} if parent else data


def slurm_sites() -> list[str]:
    names = sorted(p.stem for p in (REPO / "sites").glob("*.toml"))
    # Site's default scheduler is "slurm"; the scheduler-less ones (local) have no script to render.
    return [n for n in names if _profile(n).get("scheduler", "slurm") != "none"]


def normalise(script: str, run_dir: Path) -> str:
    for value, placeholder in ((str(run_dir), "@RUN_DIR@"), (str(run_dir.parent), "@RUNS_DIR@"),
                               (sys.executable, "@PYTHON@")):
        script = script.replace(shlex.quote(value), placeholder).replace(value, placeholder)
    return re.sub(r"^(# Rendered by hpcrl )\S+( for site )", r"\g<1>@VERSION@\g<2>", script, flags=re.M)


def test_shipped_sites_are_found():
    assert {"frontier", "cuda", "testbed"} <= set(slurm_sites()) and "local" not in slurm_sites()


@pytest.mark.parametrize("site", slurm_sites())
def test_rendered_script_matches_golden(hpcrl, tmp_path, site):
    _check_golden(hpcrl, tmp_path, site, site, [])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_variant_matches_golden(hpcrl, tmp_path, variant):
    site, extra = VARIANTS[variant]
    _check_golden(hpcrl, tmp_path, variant, site, extra)


def _check_golden(hpcrl, tmp_path, name: str, site: str, extra: list[str]) -> None:
    run_dir = tmp_path / "run"
    args = ["render", "--site", site, *FIXED_ARGS, *extra, "--run-dir", run_dir]
    if _profile(site).get("account_required"):
        args += ["-A", ACCOUNT]
    # A developer's own site directories must not leak into the shipped profiles, nor their Hugging Face
    # cache into site.hf_home = "auto" (which keeps the submitting shell's hub cache).
    r = hpcrl(*args, env={"HPCRL_SITES_PATH": "", "HF_HOME": "", "HF_HUB_CACHE": GOLDEN_HUB_CACHE})
    assert r.returncode == 0, f"hpcrl {' '.join(map(str, args))} failed:\n{r.stderr}"
    actual = normalise((run_dir / "job.sbatch").read_text(), run_dir)
    golden = GOLDEN / f"{name}.sbatch"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(actual)
        return
    if not golden.is_file():
        pytest.fail(f"no golden script {golden.relative_to(REPO)} for {name}; create it with\n    {REGENERATE}")
    expected = golden.read_text()
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                            fromfile=f"tests/golden/{name}.sbatch",
                                            tofile=f"hpcrl render --site {site} {' '.join(extra)}"))
        pytest.fail(f"the rendered script for {name} differs from its golden file:\n{diff}\n"
                    f"If the change is intended, regenerate with\n    {REGENERATE}\n"
                    "and review `git diff tests/golden/`.", pytrace=False)


def test_no_stale_golden_files():
    stale = sorted(p.name for p in GOLDEN.glob("*.sbatch") if p.stem not in [*slurm_sites(), *VARIANTS])
    assert not stale, f"golden scripts for sites that are not shipped Slurm sites (delete them): {stale}"
