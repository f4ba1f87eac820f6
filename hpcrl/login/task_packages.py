"""What the tasks' Python must hold for a recipe, checked on the login node where the tasks run its
interpreter (no container): a package it lacks fails only when the job starts, after the queue.
hpcrl.login.compose calls `check`; `importable` also serves its reward-module checks.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpcrl.job.errors import UserError
from hpcrl.job.grpo_config import LOW_BIT_OPTIMS
from hpcrl.job.recipe import Recipe, auto_engines
from hpcrl.job.site import Site


def check(site: Site, recipe: Recipe) -> None:
    """The inference engine the recipe needs (_check_vllm), and torchao for grpo.optim adamw_torch_8bit."""
    _check_vllm(site, recipe)
    if recipe.grpo.optim in LOW_BIT_OPTIMS and not importable("torchao"):
        raise UserError(f"grpo.optim: {recipe.grpo.optim} is torchao's 8-bit AdamW, and {sys.executable}, which "
                        f"the tasks run, has no torchao; install it (pip install torchao), or use "
                        f"adamw_torch_fused")


def _check_vllm(site: Site, recipe: Recipe) -> None:
    """An engine the tasks would not find: inference.engine vllm, and auto where only vLLM serves (a GPU
    site, whose auto never falls back to the transformers engine; structured outputs)."""
    engine, regex = recipe.inference.engine, recipe.grpo.vllm_structured_outputs_regex is not None
    only_vllm = engine == "vllm" or (engine == "auto" and (regex or auto_engines(site.device) == ("vllm",)))
    if not only_vllm or importable("vllm"):
        return
    if engine == "vllm":
        raise UserError(f"inference.engine: vllm: no vllm in {sys.executable}, which the tasks run; install the "
                        f"site's vLLM build into it, or set inference.engine=transformers")
    if regex:
        raise UserError(f"grpo.vllm_structured_outputs_regex: structured outputs need the vLLM engine, and "
                        f"{sys.executable}, which the tasks run, has no vllm (inference.engine: auto would use "
                        f"the transformers engine, which samples free text)")
    raise UserError(f"inference.engine: auto found no vllm in {sys.executable} (which the tasks run) on a GPU "
                    f"site; install the site's vLLM build into it, or set inference.engine=transformers to "
                    f"generate with the transformers engine on purpose")


def importable(top: str) -> bool:
    """Whether the tasks' interpreter finds `top`. Not through the current directory, which
    `python -m hpcrl` puts first on sys.path: the tasks run in the run directory."""
    import importlib.util

    saved = list(sys.path)
    if sys.path and sys.path[0] in ("", str(Path.cwd())):
        del sys.path[0]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved
