"""The job spec: recipe + site + flags, validated and frozen. The ONLY thing the compute side reads.

Data flows one way: recipe.yaml (+ key=value) -> Recipe; site name (+ overrides) -> Site;
both + resources -> JobSpec (hpcrl.login.compose) -> <run_dir>/job.json -> the tasks (JobSpec.load).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hpcrl.job.config import build, to_dict
from hpcrl.job.errors import UserError
from hpcrl.job.placement import Plan, make_plan
from hpcrl.job.recipe import Recipe
from hpcrl.job.rundir import SPEC_FILE
from hpcrl.job.site import Site

SPEC_VERSION = 1


@dataclass(frozen=True)
class JobSpec:
    version: int
    hpcrl_version: str
    created_at: float
    run_dir: str
    site: Site
    recipe: Recipe
    time_s: int
    python: str             # the interpreter the tasks run
    # The recipe's own modules (rewards', and an agent's tools' and environments') found beside the
    # recipe or in the current directory (files, or package directories), as compose found them: the
    # run directory keeps copies (rundir.REWARDS_DIR), which the trainers import, so a job runs the
    # code it was submitted with.
    reward_modules: tuple[str, ...] = ()
    # The model directory the job copies to each node's site.stage.model_dest before the run, as
    # compose resolved model.path on the login node ("" = not staged: the demo, or no model_dest).
    model_source: str = ""
    # trainer.engine=deepspeed: the user's DeepSpeed settings (trainer.deepspeed_config's JSON with
    # trainer.accelerate_config's) as compose read them on the login node, so the job runs with the
    # configuration it was submitted with however the files change later. The trainers' config is
    # hpcrl.job.deepspeed.config_for_job(spec, device_type); None: no user settings.
    deepspeed_user: Optional[dict[str, Any]] = None
    # Seconds before the time limit that Slurm sends site.signal, as compose settled them: the site's
    # own lead, or for "NAME@auto" one derived from the checkpoint (hpcrl.job.signal_lead). 0: none.
    signal_lead_s: int = 0
    # site.stage.python_env "auto" (or python_env_from_nodes): the environment compose found for the
    # job's interpreter, which the batch script packs into the tarball stage.python_env names unless an
    # earlier job did (hpcrl.login.python_env). "" = a tarball the user gave, or no staging.
    python_env_source: str = ""

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def nodes(self) -> int:
        return self.recipe.resources.nodes

    def plan(self) -> Plan:
        return make_plan(self.site, self.nodes, self.recipe.inference.gpus,
                         self.recipe.inference.tensor_parallel_size)

    def environment(self) -> dict[str, str]:
        """The site's variables for this job: env, with env_single_node or env_multi_node over it.
        Unexpanded, so that each launcher expands them its own way: the sbatch script in the job's
        shell (hpcrl.login.render quotes them), `hpcrl run` in-process (hpcrl.login.local)."""
        site = self.site
        return {**site.env, **(site.env_single_node if self.nodes == 1 else site.env_multi_node)}

    def node_model_dir(self) -> str | None:
        """Where this node's staged copy of the model is (site.stage.model_dest, expanded in this
        task's environment); None when the model is not staged."""
        if not self.model_source:
            return None
        return os.path.expandvars(self.site.stage.model_dest)

    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        return build(cls, json.loads(text), "job.json")

    @classmethod
    def load(cls, run_dir: str | Path) -> "JobSpec":
        path = Path(run_dir) / SPEC_FILE
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            raise UserError(f"run_dir: no {SPEC_FILE} in {run_dir}") from None
