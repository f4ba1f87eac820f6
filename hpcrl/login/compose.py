"""recipe file + key=value + flags + site -> a validated JobSpec. Nothing is written here.

Every check a login node can make happens here, before a job waits in a queue; a mistake is a
UserError naming the field. That includes memory: a job whose estimate (hpcrl.job.fit) does not fit
its GPUs is refused with the fix.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcrl import __version__
from hpcrl.job.config import build, closest, set_dotted
from hpcrl.job.errors import UserError
from hpcrl.job.placement import Plan, make_plan
from hpcrl.job.recipe import Recipe
from hpcrl.job.site import Site
from hpcrl.job.slurm_time import parse_walltime
from hpcrl.job.spec import SPEC_VERSION, JobSpec
from hpcrl.login import profiles

# Job names, accounts, partitions and QOS land on #SBATCH lines: one plain token only.
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+\-]{1,128}$")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def read_recipe(path: str | None) -> dict:
    """The raw mapping of a recipe file ({} for the built-in demo)."""
    if path is None:
        return {}
    import yaml     # only here: `hpcrl status` and the built-in demo never parse YAML

    p = Path(path)
    if not p.is_file():
        raise UserError(f"recipe: no such file {path!r}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise UserError(f"recipe {path}: invalid YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise UserError(f"recipe {path}: not a UTF-8 text file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: the top level must be a mapping of fields, got {type(data).__name__}")
    return data


def apply_overrides(data: dict, assignments: list[str]) -> dict:
    """Apply `key.path=value` arguments; values are parsed as YAML scalars/lists ("3", "true", "[a, b]")."""
    if assignments:
        import yaml
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][\w]*(\.[A-Za-z_0-9][\w]*)*$", key):
            raise UserError(f"override {item!r}: expected key.path=value (e.g. grpo.learning_rate=1e-5)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if value is not None and not isinstance(value, (str, int, float, bool, list, dict)):
            value = raw         # a YAML date or the like: keep the text
        set_dotted(data, key, value)
    return data


def _check_text(value: str, where: str) -> None:
    if CONTROL_CHARS.search(value):
        raise UserError(f"{where}: control characters (newline, tab, ...) are not allowed")


def _validate_resources(site: Site, recipe: Recipe, need_account: bool = True) -> int:
    res = recipe.resources
    if res.nodes < 1:
        raise UserError(f"nodes: must be at least 1, got {res.nodes}")
    for field_name, value in (("name", recipe.name), ("account", res.account),
                              ("partition", res.partition), ("qos", res.qos)):
        if value and not SLURM_NAME.match(value):
            raise UserError(f"{field_name}: {value!r} is not allowed; use letters, digits and _ . + - (at most 128)")
    for field_name, opts in (("resources.sbatch_options", res.sbatch_options), ("resources.srun_options", res.srun_options)):
        for opt in opts:
            _check_text(opt, field_name)
            if not opt.startswith("-") or (field_name.endswith("sbatch_options") and re.search(r"\s", opt)):
                raise UserError(f"{field_name}: {opt!r} is not an option like \"--exclusive\" or \"--mem=0\"")
    time_s = parse_walltime(res.time)
    if site.scheduler == "none":
        return time_s
    if need_account and site.account_required and not res.account:
        raise UserError(f"account: site {site.name} requires a project account (-A PROJECT_ID)")
    if site.partitions and res.partition and res.partition not in site.partitions:
        raise UserError(f"partition: {res.partition!r} is not a partition of {site.name}"
                        f"{closest(res.partition, site.partitions)}; known: {', '.join(site.partitions)}")
    part = site.partitions.get(res.partition)
    if part is not None:
        pname = res.partition
        if part.max_nodes is not None and res.nodes > part.max_nodes:
            raise UserError(f"nodes: {res.nodes} is over partition {pname}'s limit of {part.max_nodes}")
        limit = None
        for b in sorted(part.walltime_bins, key=lambda b: b.max_nodes):
            if res.nodes <= b.max_nodes:
                limit = b.max_time
                break
        if limit and time_s > parse_walltime(limit):
            raise UserError(f"time: {res.time} is over the {limit} limit for {res.nodes} node(s) "
                            f"in partition {pname} on {site.name}")
        if part.max_time and time_s > parse_walltime(part.max_time):
            raise UserError(f"time: {res.time} is over partition {pname}'s limit of {part.max_time}")
    qos = site.qos_limits.get(res.qos)
    if qos is not None:
        if qos.max_time and time_s > parse_walltime(qos.max_time):
            raise UserError(f"time: {res.time} is over QOS {res.qos}'s limit of {qos.max_time} on {site.name}")
        if qos.max_nodes and res.nodes > qos.max_nodes:
            raise UserError(f"nodes: {res.nodes} is over QOS {res.qos}'s limit of {qos.max_nodes}")
    return time_s


def _validate_batch(recipe: Recipe) -> None:
    g = recipe.grpo
    per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
    # Each trainer generates whole groups, so group-relative advantages need no cross-rank gather.
    if per_rank % g.num_generations:
        raise UserError(f"grpo.num_generations: {g.num_generations} does not divide the {per_rank} completions "
                        f"each trainer takes per step (per_device_train_batch_size x gradient_accumulation_steps)")
    if recipe.inference.max_model_len <= g.max_completion_length:
        raise UserError(f"inference.max_model_len: {recipe.inference.max_model_len} leaves no room for prompts "
                        f"beside grpo.max_completion_length={g.max_completion_length}")


def split_recipe_and_overrides(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """`hpcrl render --site x grpo.beta=0.1` has no recipe: the positional is an override; in
    `grpo.beta=0 -N 2 recipe.yaml` the file came after the options."""
    overrides = list(overrides)
    if recipe and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        overrides.insert(0, recipe)
        recipe = None
    if recipe is None:
        files = [item for item in overrides if "=" not in item]
        if len(files) == 1:
            recipe = files[0]
            overrides.remove(files[0])
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r}: expected key=value (only one recipe file may be given)")
    return recipe, overrides


def resource_flags(nodes=None, time=None, account=None, partition=None, qos=None, name=None) -> dict[str, Any]:
    """The command-line flags (-N, -t, -A, -p, -q, -J) as the recipe fields they set."""
    return {"resources.nodes": nodes, "resources.time": time, "resources.account": account,
            "resources.partition": partition, "resources.qos": qos, "name": name}


def from_args(args) -> JobSpec:
    """A job command's parsed arguments (run, render, submit) -> JobSpec."""
    recipe, overrides = split_recipe_and_overrides(args.recipe, args.overrides)
    args.recipe, args.overrides = recipe, overrides
    flags = resource_flags(args.nodes, args.time, args.account, args.partition, args.qos, args.name)
    return compose(recipe, args.site, overrides, flags, args.run_dir)


def for_plan(args) -> JobSpec:
    """`hpcrl plan`'s arguments -> the JobSpec render would make, less what only a submission
    needs: no run directory (none is named, checked or written) and no account. The memory
    estimate is shown by plan, not refused here."""
    if not args.site:
        raise UserError("plan: --site is required (see `hpcrl sites`)")
    recipe, overrides = split_recipe_and_overrides(args.recipe, args.overrides)
    if args.server_gpus is not None:
        overrides.append(f"inference.gpus={args.server_gpus}")      # the flag wins, like -N
    flags = resource_flags(args.nodes, args.time, args.account, args.partition, args.qos)
    return compose(recipe, args.site, overrides, flags, for_plan=True)


def for_slurm(args) -> JobSpec:
    """`hpcrl render`'s and `hpcrl submit`'s arguments -> JobSpec, for a site with Slurm only."""
    if not args.site:
        raise UserError(f"{args.command}: --site is required (see `hpcrl sites`)")
    spec = from_args(args)
    if spec.site.scheduler != "slurm":
        raise UserError(f"--site: {spec.site.name} has no Slurm; use `hpcrl run` for it")
    return spec


def compose(recipe_path: str | None, site_name: str, assignments: list[str] = (),
            flags: dict[str, Any] | None = None, run_dir: str | None = None, *,
            check_fit: bool = True, for_plan: bool = False) -> JobSpec:
    """Recipe file + key=value + flags + site -> a validated JobSpec (nothing is written).

    `check_fit`: refuse a job whose memory estimate is over its GPUs' (unknown sizes never are).
    `for_plan`: `hpcrl plan`'s spec: no account needed, no run directory (run_dir is ""), no refusal."""
    data = apply_overrides(read_recipe(recipe_path), list(assignments))
    for key, value in (flags or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    recipe = build(Recipe, data)
    site = profiles.load(site_name, recipe.site)
    # Site defaults fill resources the recipe and flags left open.
    res = recipe.resources
    recipe = replace(recipe, resources=replace(res, partition=res.partition or site.partition,
                                               qos=res.qos or site.qos))
    time_s = _validate_resources(site, recipe, need_account=not for_plan)
    _validate_batch(recipe)
    plan = make_plan(site, recipe.resources.nodes, recipe.inference.gpus)   # server GPUs vs GPUs per node
    python = sys.executable if site.python == "auto" else site.python
    if python == sys.executable:
        _check_reward_modules(recipe)
    if for_plan:
        return JobSpec(SPEC_VERSION, __version__, time.time(), "", site, recipe, time_s, python)
    run_path = Path(run_dir) if run_dir else default_run_dir(site, recipe.name)
    run_path = run_path.expanduser().absolute()
    _check_text(str(run_path), "--run-dir")
    if re.search(r"[\"%\\]", str(run_path)):
        raise UserError(f"--run-dir: {str(run_path)!r}: quotes, backslashes and % cannot appear in a run directory")
    if run_path.exists():
        raise UserError(f"--run-dir: {run_path} already exists")
    _check_writable_on_compute(site, run_path, "--run-dir")
    if recipe.checkpoint.dir:
        _check_writable_on_compute(site, Path(recipe.checkpoint.dir).expanduser().absolute(), "checkpoint.dir")
    spec = JobSpec(SPEC_VERSION, __version__, time.time(), str(run_path), site, recipe, time_s, python)
    if check_fit:
        _check_fit(spec, plan)
    return spec


def _check_fit(spec: JobSpec, plan: Plan) -> None:
    """A job that cannot fit its GPUs fails here, not after hours in the queue and minutes of
    loading. Only a known estimate against a known memory refuses: the demo models (built in the
    job), a model directory this machine cannot read and a site without memory sizes never do."""
    if spec.recipe.mode != "train":
        return              # a probe loads no model
    from hpcrl.job.fit import estimate      # here: `hpcrl status` and `--help` never load it

    refusal = estimate(spec, plan).refusal(spec.site.name)
    if refusal:
        raise UserError(refusal)


def _check_writable_on_compute(site: Site, path: Path, where: str) -> None:
    """The job writes its run and checkpoint directories from the compute nodes. Symlinks are
    followed: ~/runs linked to a scratch file system is fine."""
    real = path.resolve()
    for readonly in site.readonly_on_compute:
        top = Path(readonly)
        if real == top or top in real.parents:
            raise UserError(f"{where}: {path} is under {readonly}, which {site.name}'s compute nodes cannot write; "
                            f"put it on a scratch file system (--run-dir DIR, or runs_dir in your site file "
                            f"~/.config/hpcrl/sites/{site.name}.toml)")


def _check_reward_modules(recipe) -> None:
    """A reward module the tasks could not import fails here, not minutes into the job. Only where
    the tasks run this very interpreter, and only the top-level package: finding it executes no
    code (a reward module may import torch, which the login side never does); the module itself
    and its function are checked when the trainer starts."""
    import importlib.util

    for i, reward in enumerate(recipe.rewards):
        top = reward.func.partition(":")[0].split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(f"rewards[{i}].func: no module named {top!r} in {sys.executable} "
                            f"(the tasks would fail to import {reward.func!r})")


def default_run_dir(site: Site, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(site.runs_dir).expanduser()
    path = base / f"{name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = base / f"{name}-{stamp}-{n}"
    return path
