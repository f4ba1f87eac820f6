"""recipe file + key=value + flags + site -> a validated JobSpec. Nothing is written here.

Every check a login node can make happens here, before a job waits in a queue; a mistake is a
UserError naming the field. That includes memory: a job whose estimate (hpcrl.job.estimate) does not fit
its GPUs is refused with the fix.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl import __version__
from hpcrl.job import context
from hpcrl.job.config import build, closest, deep_merge, problems_error, set_dotted, unknown_fields
from hpcrl.job.demo import is_demo
from hpcrl.job.errors import UserError
from hpcrl.job.hfcache import MAIN, is_glob, is_hub_id
from hpcrl.job.placement import Plan, make_plan
from hpcrl.job.grpo_config import DEMO_GRPO
from hpcrl.job.recipe import DATASET_BUILDERS, DataConfig, Recipe
from hpcrl.job.recipe import TRL_REWARDS_MATH_VERIFY, expand_shorthands, reward_import_path
from hpcrl.job.site import Site
from hpcrl.job.slurm_time import parse_walltime
from hpcrl.job.spec import SPEC_VERSION, JobSpec
from hpcrl.login import deepspeed_inputs, job_env, profiles, python_env, task_packages, write_dirs
from hpcrl.login.module_imports import with_imported
from hpcrl.login.task_packages import importable as _importable
if TYPE_CHECKING:
    from hpcrl.login.trl_config import Translation

# Job names, accounts, partitions and QOS land on #SBATCH lines: one plain token only.
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.+\-]{1,128}$")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
_SECTIONS = {f.name for f in fields(Recipe)}


def read_recipe(path: str | None) -> dict:
    """The raw mapping of a recipe file ({} for the built-in demo)."""
    if path is None:
        return {}
    import yaml     # only here: `hpcrl status` and the built-in demo never parse YAML

    from hpcrl.login import strict_yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"recipe: no such file {path!r}")
    try:
        data = strict_yaml.load(p.read_text())
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

        from hpcrl.login import strict_yaml
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][\w]*(\.[A-Za-z_0-9][\w]*)*$", key):
            raise UserError(f"override {item!r}: expected key.path=value (e.g. grpo.learning_rate=1e-5)")
        try:
            value = strict_yaml.load(raw) if raw.strip() else ""
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
    if recipe.grpo.tf32 and not (site.gpu_vendor == "nvidia" and site.device == "cuda"):
        # transformers raises the same on a GPU without TF32 (ROCm's included) and on a CPU.
        raise UserError(f"grpo.tf32: TF32 needs NVIDIA GPUs (Ampere or newer), and site {site.name}'s trainers run "
                        f"on {site.gpu_vendor if site.device == 'cuda' else 'CPUs'}: leave it unset")
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
        if not qos.allows_dependencies and any(re.match(r"--dependency|-d", opt) for opt in res.sbatch_options):
            raise UserError(f"resources.sbatch_options: QOS {res.qos} on {site.name} does not allow job "
                            f"dependencies (--dependency)")
    return time_s


def _validate_batch(recipe: Recipe, num_trainers: int) -> None:
    g = recipe.grpo
    if g.generation_batch_size is not None:
        step = g.per_device_train_batch_size * num_trainers
        micro = g.generation_batch_size // step
        if g.generation_batch_size % step or micro % g.gradient_accumulation_steps:
            raise UserError(f"grpo.generation_batch_size: {g.generation_batch_size} is not a whole number of "
                            f"optimizer steps of per_device_train_batch_size x gradient_accumulation_steps x "
                            f"{num_trainers} trainer(s) ({step * g.gradient_accumulation_steps} completions)")
    per_rank = g.per_device_train_batch_size * g.micro_batches_per_generation(num_trainers)
    # Each trainer generates whole groups, so group-relative advantages need no cross-rank gather.
    if per_rank % g.num_generations:
        raise UserError(f"grpo.num_generations: {g.num_generations} does not divide the {per_rank} completions "
                        f"each trainer generates at once (per_device_train_batch_size x steps_per_generation, "
                        f"which is gradient_accumulation_steps unless set)")
    _validate_context(recipe)
    _validate_router_aux(recipe)


def _validate_router_aux(recipe: Recipe) -> None:
    """TRL refuses a load-balancing coefficient for a model without routers; so does hpcrl, before
    the job waits in a queue (where the login node can read the model's config.json)."""
    if not recipe.grpo.router_aux_loss_coef:
        return
    from hpcrl.job.model_shape import model_shape

    shape, _ = model_shape(recipe.model.path)
    if shape is not None and not shape.experts:
        raise UserError(f"grpo.router_aux_loss_coef: {recipe.grpo.router_aux_loss_coef} is set, but "
                        f"{recipe.model.path} is not a mixture-of-experts model (it has no routers)")


def _validate_context(recipe: Recipe) -> None:
    """An engine context the recipe sets, against the completions and the model (TRL's
    vllm_max_model_length; unset, the engine takes the model's own, as vLLM and TRL do)."""
    asked, g = recipe.inference.max_model_len, recipe.grpo
    if asked is None:
        return
    if asked <= g.max_completion_length:
        raise UserError(f"inference.max_model_len: {asked} leaves no room for prompts beside "
                        f"grpo.max_completion_length={g.max_completion_length}; raise it, or leave it unset for "
                        f"the model's own context")
    model = context.model_context(recipe.model.path, recipe.model.tokenizer)
    if model is not None and asked > model.tokens:
        # vLLM refuses it on the node ("User-specified max_model_len ... is greater than the derived")
        raise UserError(f"inference.max_model_len: {asked} is over the model's context of {model.tokens} tokens "
                        f"({model.source}), which vLLM refuses; leave it unset for the model's own")


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
            check_fit: bool = True, for_plan: bool = False, check_inputs: bool = True) -> JobSpec:
    """Recipe file + key=value + flags + site -> a validated JobSpec (nothing is written).

    `check_fit`: refuse a job whose memory estimate is over its GPUs' (unknown sizes never are).
    `check_inputs`: refuse a model, tokenizer or dataset the job could not load (hpcrl.login.inputs).
    `for_plan`: `hpcrl plan`'s spec: no account needed, no run directory (run_dir is ""), no refusal."""
    resolved = build_recipe(recipe_path, assignments, flags)
    try:
        return _compose(resolved.recipe, recipe_path, site_name, run_dir, check_fit=check_fit, for_plan=for_plan,
                        check_inputs=check_inputs)
    except UserError as e:
        if resolved.trl is None:
            raise
        raise _in_trl_terms(e, resolved.trl) from None


def _compose(recipe: Recipe, recipe_path: str | None, site_name: str, run_dir: str | None, *,
             check_fit: bool, for_plan: bool, check_inputs: bool) -> JobSpec:
    site = profiles.load(site_name, recipe.site)
    # Site defaults fill resources the recipe and flags left open.
    res = recipe.resources
    recipe = replace(recipe, resources=replace(res, partition=res.partition or site.partition,
                                               qos=res.qos or site.qos))
    time_s = _validate_resources(site, recipe, need_account=not for_plan)
    plan = make_plan(site, recipe.resources.nodes, recipe.inference.gpus,
                     recipe.inference.tensor_parallel_size)   # server GPUs vs GPUs per node
    _validate_batch(recipe, plan.num_trainers)
    notes: list[str] = []           # warnings, printed once nothing refused the job
    deepspeed_sources = deepspeed_inputs.read(recipe, notes) if recipe.trainer.engine == "deepspeed" else []
    deepspeed_user = None
    if deepspeed_sources:
        from hpcrl.job.deepspeed import asked_offloads, merge_user

        deepspeed_user = merge_user(deepspeed_sources)
        # What the user's settings offload, the recipe says too: job.json's recipe tells what runs.
        recipe = replace(recipe, trainer=replace(recipe.trainer, **asked_offloads(deepspeed_user)))
    python = sys.executable if site.python == "auto" else site.python
    lead_s = _signal_lead_s(site, recipe, time_s, plan)
    reward_modules = _reward_modules(recipe, recipe_path, check_installed=python == sys.executable)
    if python == sys.executable and not site.container.image:
        task_packages.check(site, recipe)
    if check_inputs and not for_plan and recipe.mode == "train":
        from hpcrl.login.inputs import check_inputs     # model, tokenizer and data, as the job will find them

        check_inputs(recipe, site)
    if for_plan:
        spec = JobSpec(SPEC_VERSION, __version__, time.time(), "", site, recipe, time_s, python,
                       deepspeed_user=deepspeed_user, signal_lead_s=lead_s)
        deepspeed_inputs.check(spec, plan, deepspeed_sources)
        _print_notes(notes)
        return spec
    run_path = Path(run_dir) if run_dir else write_dirs.default_run_dir(site, recipe.name)
    run_path = run_path.expanduser().absolute()
    _check_text(str(run_path), "--run-dir")
    if re.search(r"[\"%\\]", str(run_path)):
        raise UserError(f"--run-dir: {str(run_path)!r}: quotes, backslashes and % cannot appear in a run directory")
    if run_path.exists():
        raise UserError(f"--run-dir: {run_path} already exists")
    write_dirs.check_writable_on_compute(site, run_path, "--run-dir")
    if recipe.checkpoint.dir:
        checkpoint_dir = Path(recipe.checkpoint.dir).expanduser().absolute()
        write_dirs.check_writable_on_compute(site, checkpoint_dir, "checkpoint.dir")
    if recipe.checkpoint.output_dir:
        output_dir = Path(recipe.checkpoint.output_dir)
        _check_text(str(output_dir), write_dirs.OUTPUT_DIR_FIELD)
        write_dirs.check_output_dir(site, output_dir, recipe.model.path)
    from hpcrl.login.inputs import model_to_stage

    site = job_env.resolve(site, run_path)       # "auto" paths beside the run directory
    site, python_env_source = python_env.resolve(site, recipe.resources.nodes, python, run_path, notes)
    model_source = model_to_stage(recipe, site) if recipe.mode == "train" else ""
    path = recipe.model.path
    if recipe.model.revision != MAIN and (Path(path).expanduser().is_dir() or not is_hub_id(path)):
        # As transformers does with TRL's model_revision and a local model_name_or_path.
        notes.append(f"model.revision {recipe.model.revision!r} is not used: model.path {path} is a directory, "
                     f"not a hub id (revisions are a hub cache's)")
    if model_source:
        _check_text(model_source, "model.path")
    spec = JobSpec(SPEC_VERSION, __version__, time.time(), str(run_path), site, recipe, time_s, python,
                   reward_modules, model_source, deepspeed_user, lead_s, python_env_source=python_env_source)
    if site.container.image:
        from hpcrl.login.launch_prefix import container_binds      # its checks, before anything is written

        container_binds(spec)
    write_dirs.check_dirs_are_this_runs(spec)
    deepspeed_inputs.check(spec, plan, deepspeed_sources)
    if check_fit:
        _check_fit(spec, plan)
    _print_notes(notes)
    return spec


@dataclass
class ResolvedRecipe:
    recipe: Recipe
    trl: Translation | None        # what a TRL configuration's keys became


def build_recipe(recipe_path: str | None, assignments: list[str] = (),
                 flags: dict[str, Any] | None = None) -> ResolvedRecipe:
    """Recipe file (hpcrl's sections, TRL's flat keys, or both) + key=value + flags -> a Recipe.
    Every field that is not accepted, anywhere, is named in one error."""
    raw = read_recipe(recipe_path)
    section_overrides = [a for a in assignments if a.partition("=")[0].split(".")[0] in _SECTIONS]
    flat_overrides = apply_overrides({}, [a for a in assignments if a not in section_overrides])
    translation = None
    data = raw
    if any(key not in _SECTIONS for key in raw) or flat_overrides:        # TRL's flat keys
        from hpcrl.login import trl_config

        translation = trl_config.translate(raw)
        on_top = trl_config.translate(flat_overrides, whole=False)
        translation.moved.update(on_top.moved)
        translation.inert.update(on_top.inert)
        translation.problems += on_top.problems
        data = deep_merge(translation.recipe, on_top.recipe)
    data = apply_overrides(data, section_overrides)
    for key, value in (flags or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    # dict.fromkeys: a key both in the file and in a key=value override is named once
    problems = list(dict.fromkeys((translation.problems if translation else []) + unknown_fields(Recipe, data)))
    if problems:
        raise problems_error(problems)
    if "name" not in data:
        data["name"] = run_name(data, recipe_path)
    if (data.get("data") or {}).get("path", DataConfig.path) == DataConfig.path \
            and not (data.get("data") or {}).get("data_files") and not (data.get("data") or {}).get("datasets"):
        # The built-in task trains with its own tuned values where the recipe says nothing.
        data["grpo"] = {**DEMO_GRPO, **(data.get("grpo") or {})}
    data = expand_shorthands(data)
    _local_paths(data)
    deepspeed_inputs.resolve_paths(data, recipe_path)
    try:
        recipe = build(Recipe, data)
    except UserError as e:
        if translation is None:
            raise
        raise _in_trl_terms(e, translation) from None
    return ResolvedRecipe(recipe, translation)


def _in_trl_terms(error: UserError, translation: Translation) -> UserError:
    """`error` naming the TRL keys the recipe gave rather than the fields they became."""
    from hpcrl.login import trl_config

    return UserError(trl_config.in_trl_terms(str(error), translation))


def run_name(data: dict, recipe_path: str | None) -> str:
    """A run's name where the recipe gives none (TRL's run_name): as TRL names it, after its
    output_dir, else after the recipe file; the built-in demo keeps Recipe.name's default. Made
    safe for Slurm's job name and the run directory (letters, digits and _ . + -)."""
    output_dir = (data.get("checkpoint") or {}).get("output_dir")
    stem = Path(str(output_dir)).name if output_dir else (Path(recipe_path).stem if recipe_path else "")
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", stem).strip("-.")[:128]
    return name or Recipe.name


def _local_paths(data: dict) -> None:
    """Relative paths as TRL takes them: from the directory hpcrl runs in (the job itself runs in
    its run directory). A model or dataset name that is no path here is left as it is."""
    for section, key, must_exist in (("model", "path", True), ("model", "tokenizer", True), ("data", "path", True),
                                     ("checkpoint", "dir", False), ("checkpoint", "output_dir", False)):
        value = (data.get(section) or {}).get(key)
        if not isinstance(value, str) or not value or value == "demo" or is_demo(value) or Path(value).is_absolute():
            continue
        path = Path(value).expanduser()
        if not must_exist or path.exists() or (section, key) == ("data", "path") and is_glob(value):
            data[section][key] = str(path.absolute())
    files = (data.get("data") or {}).get("data_files")
    if isinstance(files, str):
        files = data["data"]["data_files"] = [files]       # one file, as load_dataset's data_files takes it
    if isinstance(files, list):
        data["data"]["data_files"] = [str(Path(f).expanduser().absolute()) if isinstance(f, str) else f
                                      for f in files]
    sources = (data.get("data") or {}).get("datasets")
    if isinstance(sources, list):
        # copies: the mapping may be a caller's (flags), which must not change under it
        data["data"] = {**data["data"], "datasets": [dict(s) if isinstance(s, dict) else s for s in sources]}
        for source in data["data"]["datasets"]:
            if isinstance(source, dict):
                _mixture_source_paths(source)
    for reward in data.get("rewards") or ():
        model = reward.get("model") if isinstance(reward, dict) else None
        if isinstance(model, str) and model and not Path(model).is_absolute() and Path(model).expanduser().exists():
            reward["model"] = str(Path(model).expanduser().absolute())


def _mixture_source_paths(source: dict) -> None:
    """A mixture source's relative paths made absolute where datasets.load_dataset would take them
    from the current directory: a builder's data_dir, and its data_files unless data_dir is given
    (they are then inside it); a local directory's own path (its data_dir and data_files are inside
    it). A hub dataset's are paths in its repository, left as they are."""
    def here(value):
        if isinstance(value, str) and value and "://" not in value and not Path(value).is_absolute():
            return str(Path(value).expanduser().absolute())
        return value

    path = source.get("path")
    if not isinstance(path, str) or not path:
        return
    if path in DATASET_BUILDERS:       # load_dataset tries its builders first, as here
        if source.get("data_dir"):
            source["data_dir"] = here(source["data_dir"])
            return
        files = source.get("data_files")
        if isinstance(files, dict):
            source["data_files"] = {k: [here(f) for f in v] if isinstance(v, list) else here(v)
                                    for k, v in files.items()}
        else:
            source["data_files"] = [here(f) for f in files] if isinstance(files, list) else here(files)
    elif Path(path).expanduser().is_dir():
        source["path"] = here(path)


def _signal_lead_s(site: Site, recipe: Recipe, time_s: int, plan: Plan) -> int:
    """The lead the job's script gives Slurm's stop signal, once the time limit is known to leave a
    step between start-up and that signal (0: no signal)."""
    if site.scheduler == "none" or not site.signal:
        return 0
    from hpcrl.job.signal_lead import signal_lead      # reads the model's size: not for `hpcrl status`

    # The lead reads the recipe and the site only: a draft of the spec, before its run directory.
    draft = JobSpec(SPEC_VERSION, __version__, 0.0, "", site, recipe, time_s, "")
    lead = signal_lead(draft, plan).lead_s
    site.check_time_limit(time_s, recipe.resources.time, lead)
    return lead


def _print_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"hpcrl: warning: {note}", file=sys.stderr)


def _check_fit(spec: JobSpec, plan: Plan) -> None:
    """A job that cannot fit its GPUs fails here, not after hours in the queue and minutes of
    loading. Only a known estimate against a known memory refuses: the demo models (built in the
    job), a model directory this machine cannot read and a site without memory sizes never do."""
    if spec.recipe.mode != "train":
        return              # a probe loads no model
    from hpcrl.job.estimate import estimate      # here: `hpcrl status` and `--help` never load it

    refusal = estimate(spec, plan).refusal(spec.site.name)
    if refusal:
        raise UserError(refusal)


def _reward_modules(recipe, recipe_path: str | None, check_installed: bool) -> tuple[str, ...]:
    """The recipe's own modules (its rewards', tools', environments' and rollout function's), to copy
    into the run directory: those in the current directory (TRL's CLI puts it on sys.path) or beside
    the recipe, unless an installed package provides the name, and the modules of those places they
    import (hpcrl.login.module_imports). Where the tasks run this very interpreter, every
    other module must be importable here: it fails now, not minutes into the job. Only top-level
    names are looked up, which executes no code (a reward module may import torch, which the login
    side never does); the module itself and its function are checked when the trainer starts, and a
    tool's, environment's or rollout function's source is read before (hpcrl.login.agent_inputs)."""
    dirs = [str(Path.cwd())]
    if recipe_path and str(Path(recipe_path).absolute().parent) not in dirs:
        dirs.append(str(Path(recipe_path).absolute().parent))
    local: dict[str, None] = {}         # in order, once each
    own: dict[str, str] = {}            # top-level module -> its file or package directory
    needs_math_verify = {f"trl.rewards.{name}" for name in TRL_REWARDS_MATH_VERIFY}
    # A reward model's directory is looked at with the policy's (hpcrl.login.inputs).
    named = [(f"rewards[{i}].func", reward_import_path(r.func), r.func) for i, r in enumerate(recipe.rewards)
             if not r.model]
    agent_inputs = None
    if recipe.agent.names_code:         # its module reads sources with ast: for an agent's recipe only
        from hpcrl.login import agent_inputs

        named += [(where, path, path) for where, path in agent_inputs.import_paths(recipe.agent)]
    for where, path, shown in named:
        top = path.partition(":")[0].split(".")[0]
        found = _own_module(top, dirs)
        if found:
            local[found] = None
            own[top] = found
        elif check_installed and not _importable(top):
            raise UserError(f"{where}: no module named {top!r} in {' or '.join(dirs)}, nor in "
                            f"{sys.executable} (the tasks would fail to import {shown!r})")
        elif check_installed and path.replace(":", ".") in needs_math_verify and not _importable("math_verify"):
            raise UserError(f"{where}: {shown} needs the math_verify package, which "
                            f"{sys.executable} lacks: {sys.executable} -m pip install math-verify")
    if agent_inputs is not None:
        agent_inputs.check_sources(recipe, own, installed=check_installed)
    return tuple(with_imported(local, lambda top: _own_module(top, dirs)))


def _own_module(top: str, dirs: list[str]) -> str | None:
    """The file, or package directory, of module `top` in `dirs`; None where there is none, or
    where the standard library or an installed distribution has the name (hpcrl itself, run from
    its checkout). A directory without __init__.py does not count: any directory of that name
    would be copied whole."""
    import importlib.machinery

    found = importlib.machinery.PathFinder.find_spec(top, dirs)
    if found is None or found.origin in (None, "namespace") or top in sys.stdlib_module_names:
        return None
    if top in _installed_top_levels():
        return None
    return str(Path(found.origin).parent) if found.submodule_search_locations else found.origin


@functools.cache
def _installed_top_levels() -> frozenset[str]:
    """The module names installed distributions provide: read once a process (every distribution's
    metadata: half a second, which a recipe of several reward modules paid for each)."""
    import importlib.metadata

    return frozenset(importlib.metadata.packages_distributions())
