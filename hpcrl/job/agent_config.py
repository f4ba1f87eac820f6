"""The recipe's agent section: multi-turn tool calling and custom rollouts as TRL's GRPOTrainer (1.16) takes them.

`tools`, `environment_factory` and `rollout_func` are GRPOTrainer's arguments of those names, given
as import paths (the forms reward functions take); grpo.max_tool_calling_iterations bounds the
turns. The login side checks each path's source without importing it (hpcrl.login.agent_inputs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from hpcrl.job.errors import UserError

# A reward function or other import path: "package.module:function" or "package.module.function".
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
# An import path that names a module and an object in it, with no empty part ("a..b", "a.").
_QUALIFIED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*|\.[A-Za-z_]\w*)")
# The dataset column that picks each row's environment when environment_factory is a mapping (TRL's).
ENVIRONMENT_COLUMN = "environment"


def split_import_path(path: str) -> tuple[str, str]:
    """(module, attribute) of "package.module:attr" or "package.module.attr", as the job imports it."""
    if ":" in path:
        module, _, attr = path.partition(":")
    else:
        module, _, attr = path.rpartition(".")
    return module, attr


def _check_path(path: str, where: str, what: str) -> None:
    if not isinstance(path, str) or not _QUALIFIED.fullmatch(path):
        raise UserError(f"{where}: {path!r} is not an import path of {what} like \"my_module:name\" or "
                        f"\"package.module.name\"")


@dataclass(frozen=True)
class AgentConfig:
    # Functions the model may call, TRL's `tools`: each with a type hint on every argument and a
    # Google-style docstring whose Args: section describes each (transformers' get_json_schema makes
    # the schema the chat template shows the model from them). A module beside the recipe or in the
    # current directory is copied into the run directory, as reward modules are.
    tools: tuple[str, ...] = ()
    # TRL's environment_factory: "" (none), the import path of a class (or of a callable returning an
    # instance) with a reset() and, as tools, its public methods; or {environment name: import path},
    # each row's `environment` column choosing. An environment's get_reward(), where defined, is a
    # reward of weight 1 beside the recipe's rewards (which may then be left out).
    environment_factory: Union[str, dict[str, str]] = ""
    # TRL's rollout_func: "" (none), or the import path of a function (prompts, trainer) -> dict that makes
    # the rollouts itself, generating through the trainer it is given (hpcrl.compute.agents.rollout_func).
    # Beside tools or environment_factory it makes the first turns, which the tool loop takes on (TRL's
    # rule). A module beside the recipe is copied as reward modules are.
    rollout_func: str = ""
    # Each tool call's bound, in seconds (a tool that hangs must not hang the step).
    tool_timeout_s: float = 60.0
    # Worker processes per trainer rank that run the tool calls.
    tool_workers: int = 4

    @property
    def enabled(self) -> bool:
        """Whether the recipe trains an agent (tools, or an environment's methods, called mid-completion)."""
        return bool(self.tools or self.environment_factory)

    @property
    def names_code(self) -> bool:
        """Whether the recipe names an agent's code: tools, environments or a rollout function."""
        return self.enabled or bool(self.rollout_func)

    def factories(self) -> dict[str | None, str] | None:
        """As TRL's GRPOTrainer normalizes environment_factory: {environment name: import path} for a
        mapping, {None: import path} for one factory, None for none."""
        if isinstance(self.environment_factory, dict):
            return dict(self.environment_factory)
        return {None: self.environment_factory} if self.environment_factory else None

    def validate(self, where: str) -> None:
        for i, path in enumerate(self.tools):
            _check_path(path, f"{where}.tools[{i}]", "a function")
            if path in self.tools[:i]:
                raise UserError(f"{where}.tools[{i}]: {path!r} is named twice")
        factory = self.environment_factory
        if isinstance(factory, dict):
            if not factory:
                raise UserError(f"{where}.environment_factory: an empty mapping; give {{environment name: import "
                                f"path}} pairs, one import path, or leave it out")
            for name, path in factory.items():
                if not name.strip():
                    raise UserError(f"{where}.environment_factory: an environment's name is empty (the rows' "
                                    f"`{ENVIRONMENT_COLUMN}` column names them)")
                _check_path(path, f"{where}.environment_factory.{name}", "a class or factory")
        elif factory:
            _check_path(factory, f"{where}.environment_factory", "a class or factory")
        if self.rollout_func:
            _check_path(self.rollout_func, f"{where}.rollout_func", "a function")
        if not self.tool_timeout_s > 0:
            raise UserError(f"{where}.tool_timeout_s: must be > 0, got {self.tool_timeout_s}")
        if self.tool_workers < 1:
            raise UserError(f"{where}.tool_workers: must be at least 1, got {self.tool_workers}")
