"""The recipe's agent section (issue #30) on the login node: every mistake in tools, environments, a
rollout function, the model's chat template or the rows' environment names is exit status 2 and one
line naming the field, before anything is written; a good agent recipe renders with its modules
copied into the run directory; a TRL configuration's agent keys translate; and the tool check agrees
with transformers' get_json_schema, which TRL calls on every tool."""

from __future__ import annotations

import ast
import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

from hpcrl.job import rundir
from hpcrl.job.config import build
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import Recipe, expand_shorthands
from hpcrl.login import agent_inputs, compose, data_rows

TESTBED = ["--site", "testbed"]
TOOLS_TEMPLATE = ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}"

MY_TOOLS = '''
from os.path import join as joined


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: the expression, e.g. "2 + 3"
    """
    return str(eval(expression))


async def search_notes(query: str, limit: int = 3) -> list[str]:
    """Searches the notes.

    Args:
        query: words to look for
        limit: how many notes at most
    """
    return []


def unhinted(expression) -> str:
    """Evaluates.

    Args:
        expression: the expression
    """


def undescribed(expression: str, base: int) -> str:
    """Evaluates.

    Args:
        expression: the expression
    """


def a_set(words: set[str]) -> str:
    """Counts.

    Args:
        words: the words
    """
'''

MY_ENV = '''
class Wordle:
    def __init__(self):
        self.solved = False

    def reset(self, **kwargs):
        self.solved = False

    def guess(self, word: str) -> str:
        """Guesses a word.

        Args:
            word: a five-letter word
        """
        return "no"

    def _score(self, word):
        return 0

    @property
    def done(self):
        return self.solved

    def get_reward(self) -> float:
        return float(self.solved)


class Sudoku(Wordle):
    def place(self, row: int, col: int, digit: int) -> str:
        """Places a digit.

        Args:
            row: the row, 1 to 9
            col: the column, 1 to 9
            digit: the digit
        """
        return ""


class Unscored:
    def reset(self):
        pass


class NoReset:
    def get_reward(self) -> float:
        return 0.0


class Unhinted(Wordle):
    def move(self, where) -> str:
        """Moves.

        Args:
            where: where to
        """


def make_wordle():
    return Wordle()
'''

# Rollout functions, TRL's rollout_func(prompts, trainer), good and bad.
MY_ROLLOUTS = '''
def run(prompts, trainer):
    return {}


def one(prompts):
    return {}


def three(prompts, trainer, env):
    return {}


def keyword(prompts, trainer, *, env):
    return {}


async def waits(prompts, trainer):
    return {}


class Rollouts:
    def __call__(self, prompts, trainer):
        return {}
'''

ROWS = [{"prompt": [{"role": "user", "content": "Play."}], "environment": "wordle"},
        {"prompt": "Solve this sudoku.", "environment": "sudoku"}]


def _model(directory: Path, template: str | None) -> Path:
    """A model directory the login checks accept (they read files, they load nothing)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text(json.dumps({} if template is None else {"chat_template": template}))
    return directory


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's directory: tool and environment modules, models with and without a tool template, data."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "my_tools.py").write_text(MY_TOOLS)
    (root / "my_env.py").write_text(MY_ENV)
    (root / "my_rollouts.py").write_text(MY_ROLLOUTS)
    _model(root / "model", TOOLS_TEMPLATE)
    _model(root / "plain-model", PLAIN_TEMPLATE)
    _model(root / "no-template-model", None)
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "tasks-typo.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({**ROWS[1], "environment": "sudoko"})
                                           + "\n")
    (root / "tasks.csv").write_text("prompt\nPlay.\n")
    return root


def _recipe(project: Path, text: str) -> Path:
    path = project / "recipe.yaml"
    path.write_text(textwrap.dedent(text).format(project=project))
    return path


GOOD = """\
model: {{path: {project}/model}}
data: {{path: {project}/tasks.jsonl}}
agent:
  tools: [my_tools.calculator, "my_tools:search_notes"]
  environment_factory: my_env.Wordle
grpo: {{max_tool_calling_iterations: 4}}
"""

ROLLOUT = """\
model: {{path: {project}/model}}
data: {{path: {project}/tasks.jsonl}}
agent: {{rollout_func: my_rollouts.run}}
rewards: [my_tools.calculator]
"""

# (id, recipe text ({project}: the project's directory), key=value arguments, what the one line must hold)
CASES = [
    ("tool-not-defined", GOOD, ["agent.tools=[my_tools.nothing]"],
     "agent.tools[0]: my_tools.nothing: module my_tools ({project}/my_tools.py) defines no 'nothing'"),
    ("tool-module-nowhere", GOOD, ["agent.tools=[no_such_tools.f]"], "agent.tools[0]: no module named 'no_such_tools'"),
    ("tool-not-a-path", GOOD, ["agent.tools=[calculator]"], "agent.tools[0]: 'calculator' is not an import path"),
    ("tool-twice", GOOD, ["agent.tools=[my_tools.calculator, my_tools.calculator]"],
     "agent.tools[1]: 'my_tools.calculator' is named twice"),
    ("tool-no-type-hint", GOOD, ["agent.tools=[my_tools.unhinted]"],
     "agent.tools[0]: my_tools.unhinted: argument 'expression' has no type hint; a tool needs a type hint on every "
     "argument and a docstring whose Google-style Args: section describes each"),
    ("tool-undescribed", GOOD, ["agent.tools=[my_tools.undescribed]"],
     "agent.tools[0]: my_tools.undescribed: its docstring has no Args: entry for 'base'"),
    ("tool-bad-type", GOOD, ["agent.tools=[my_tools.a_set]"],
     "agent.tools[0]: my_tools.a_set: argument 'words': set[str] is not a type transformers can describe"),
    ("factory-not-defined", GOOD, ["agent.environment_factory=my_env.Chess"],
     "agent.environment_factory: my_env.Chess: module my_env ({project}/my_env.py) defines no 'Chess'"),
    ("factory-no-reset", GOOD, ["agent.environment_factory=my_env.NoReset"],
     "agent.environment_factory: my_env.NoReset defines no reset method, which TRL requires of an environment"),
    ("factory-method-unhinted", GOOD, ["agent.environment_factory=my_env.Unhinted"],
     "agent.environment_factory: my_env.Unhinted.move: argument 'where' has no type hint; TRL offers each public "
     "method of an environment to the model as a tool"),
    ("factory-wrong-type", GOOD, ["agent.environment_factory=[my_env.Wordle]"],
     "agent.environment_factory: expected a string or a mapping, got ['my_env.Wordle']"),
    ("factory-empty-mapping", GOOD, ["agent.environment_factory={{}}"], "agent.environment_factory: an empty mapping"),
    ("no-reward-source", GOOD, ["agent.environment_factory=my_env.Unscored"],
     "rewards: none given, and no environment of agent.environment_factory (my_env.Unscored) defines get_reward"),
    ("no-rewards-without-environment", GOOD, ["agent.environment_factory="],
     "rewards: at least one reward function is required (an agent recipe may leave them out only with "
     "agent.environment_factory"),
    ("iterations-negative", GOOD, ["grpo.max_tool_calling_iterations=-1"],
     "grpo.max_tool_calling_iterations: must be >= 0, or null for no bound, got -1"),
    ("iterations-without-agent", None, ["grpo.max_tool_calling_iterations=3"],
     "grpo.max_tool_calling_iterations: bounds an agent's tool calls; it needs agent.tools or agent.environment_factory"),
    ("tool-timeout", GOOD, ["agent.tool_timeout_s=0"], "agent.tool_timeout_s: must be > 0, got 0.0"),
    ("tool-workers", GOOD, ["agent.tool_workers=0"], "agent.tool_workers: must be at least 1, got 0"),
    ("template-without-tools", GOOD, ["model.path={project}/plain-model"],
     "model.path: {project}/plain-model's chat template cannot render tools (it never uses `tools`), which "
     "agent.tools and agent.environment_factory need; use a model whose chat template supports tool calling"),
    ("no-template", GOOD, ["model.path={project}/no-template-model"],
     "model.path: {project}/no-template-model has no chat template"),
    ("tokenizer-template-without-tools", GOOD, ["model.tokenizer={project}/plain-model"],
     "model.tokenizer: {project}/plain-model's chat template cannot render tools"),
    ("demo-model", GOOD, ["model.path=demo:tiny"], "model.path: demo:tiny: the demo model's chat template has no tools"),
    ("environment-row-unknown", GOOD, ["agent.environment_factory={{wordle: my_env.Wordle, sudoku: my_env.Sudoku}}",
                                       "data.path={project}/tasks-typo.jsonl"],
     "data.path: {project}/tasks-typo.jsonl line 2: column \"environment\" is 'sudoko', not one of "
     "agent.environment_factory's names (wordle, sudoku)"),
    ("environment-column-missing", GOOD, ["agent.environment_factory={{wordle: my_env.Wordle}}",
                                          "data.path={project}/tasks.csv"],
     "data.path: {project}/tasks.csv line 2: column \"environment\" is missing, not one of"),
    ("environment-demo-data", GOOD, ["agent.environment_factory={{wordle: my_env.Wordle}}", "data.path=demo"],
     "agent.environment_factory: a mapping picks each row's environment by its `environment` column, which the "
     "demo task's rows lack"),
    ("environment-column-dropped", GOOD, ["agent.environment_factory={{wordle: my_env.Wordle}}", "data.path=demo",
                                          "data.datasets=[{{path: json, data_files: {project}/tasks.jsonl, "
                                          "columns: [prompt]}}]"],
     "data.datasets[0].columns: keeps no 'environment' column"),
    ("rollout-func-not-defined", ROLLOUT, ["agent.rollout_func=my_rollouts.nothing"],
     "agent.rollout_func: my_rollouts.nothing: module my_rollouts ({project}/my_rollouts.py) defines no 'nothing'"),
    ("rollout-func-module-nowhere", ROLLOUT, ["agent.rollout_func=no_such_rollouts.run"],
     "agent.rollout_func: no module named 'no_such_rollouts'"),
    ("rollout-func-not-a-path", ROLLOUT, ["agent.rollout_func=run"],
     "agent.rollout_func: 'run' is not an import path of a function"),
    ("rollout-func-one-argument", ROLLOUT, ["agent.rollout_func=my_rollouts.one"],
     "agent.rollout_func: my_rollouts.one: it takes 1 positional argument, not two; TRL calls "
     "rollout_func(prompts, trainer) and takes the dict it returns"),
    ("rollout-func-three-arguments", ROLLOUT, ["agent.rollout_func=my_rollouts.three"],
     "agent.rollout_func: my_rollouts.three: it takes 3 positional arguments without defaults, not two"),
    ("rollout-func-keyword", ROLLOUT, ["agent.rollout_func=my_rollouts.keyword"],
     "agent.rollout_func: my_rollouts.keyword: its keyword-only argument 'env' has no default"),
    ("rollout-func-async", ROLLOUT, ["agent.rollout_func=my_rollouts.waits"],
     "agent.rollout_func: my_rollouts.waits: it is async (TRL does not await it)"),
    ("rollout-func-class", ROLLOUT, ["agent.rollout_func=my_rollouts.Rollouts"],
     "agent.rollout_func: my_rollouts.Rollouts: it is a class, not a function"),
    # Beside a rollout function the tools are checked as they are alone.
    ("rollout-func-with-an-unhinted-tool", ROLLOUT, ["agent.tools=[my_tools.unhinted]"],
     "agent.tools[0]: my_tools.unhinted: argument 'expression' has no type hint"),
    ("rollout-func-no-rewards", ROLLOUT.replace("rewards: [my_tools.calculator]\n", ""), [],
     "rewards: at least one reward function is required"),
    ("trl-rollout-func", "model_name_or_path: {project}/model\ndataset_name: {project}/tasks.jsonl\n"
                         "reward_funcs: [my_tools.calculator]\nrollout_func: my_rollouts.one\n", [],
     "rollout_func (agent.rollout_func): my_rollouts.one: it takes 1 positional argument, not two"),
    ("trl-tool-named-by-its-key", "model_name_or_path: {project}/model\ndataset_name: {project}/tasks.jsonl\n"
                                  "reward_funcs: [my_tools.calculator]\ntools: [my_tools.unhinted]\n", [],
     "tools (agent.tools[0]): my_tools.unhinted: argument 'expression' has no type hint"),
]


@pytest.mark.parametrize("case_id,recipe,args,expect", CASES, ids=[c[0] for c in CASES])
def test_a_bad_agent_input_is_one_line_and_exit_2(hpcrl, project, case_id, recipe, args, expect):
    argv = [*TESTBED, *(a.format(project=project) for a in args)]
    if recipe is not None:
        argv.append(str(_recipe(project, recipe)))
    r = hpcrl("submit", *argv)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcrl: error: "), r.stderr
    assert expect.format(project=project) in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout and r.stdout == ""
    assert list(hpcrl.work.iterdir()) == [], "something was written"
    assert not (hpcrl.home / "registry.sqlite").exists(), "a job was registered"


def _render(hpcrl, *args, **kw) -> Path:
    r = hpcrl("render", *TESTBED, *map(str, args), **kw)
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())


def test_a_good_agent_recipe_renders_with_its_modules_copied(hpcrl, project):
    run_dir = _render(hpcrl, _recipe(project, GOOD))
    spec = json.loads((run_dir / rundir.SPEC_FILE).read_text())
    recipe = spec["recipe"]
    assert recipe["agent"] == {"tools": ["my_tools.calculator", "my_tools:search_notes"],
                               "environment_factory": "my_env.Wordle", "rollout_func": "", "tool_timeout_s": 60.0,
                               "tool_workers": 4}
    assert recipe["grpo"]["max_tool_calling_iterations"] == 4
    assert recipe["rewards"] == []          # the environment's get_reward scores; no demo rewards added
    assert spec["reward_modules"] == [str(project / "my_tools.py"), str(project / "my_env.py")]
    copies = run_dir / rundir.REWARDS_DIR
    assert sorted(p.name for p in copies.iterdir()) == ["my_env.py", "my_tools.py"]
    assert (copies / "my_env.py").read_text() == MY_ENV


def test_the_modules_a_tool_module_imports_beside_it_are_copied_too(hpcrl, project):
    """A tools module that imports a helper beside it (and, through it, a package beside it) runs in
    the run directory only if they are copied with it; installed and standard modules are not."""
    helpers = project / "helpers"
    helpers.mkdir()
    (helpers / "__init__.py").write_text("from helpers.digits import digit_sum\n")
    (helpers / "digits.py").write_text("def digit_sum(n):\n    return sum(map(int, str(n)))\n")
    (project / "calc_core.py").write_text("import json\nimport yaml\nfrom helpers import digit_sum\n")
    (project / "wrapped_tools.py").write_text("import os\nfrom calc_core import digit_sum\n\n" + MY_TOOLS)
    run_dir = _render(hpcrl, _recipe(project, GOOD.replace("my_tools.calculator", "wrapped_tools.calculator")))
    spec = json.loads((run_dir / rundir.SPEC_FILE).read_text())
    assert spec["reward_modules"] == [str(project / "wrapped_tools.py"), str(project / "my_tools.py"),
                                      str(project / "my_env.py"), str(project / "calc_core.py"), str(helpers)]
    copied = run_dir / rundir.REWARDS_DIR
    assert (copied / "calc_core.py").is_file() and (copied / "helpers" / "digits.py").is_file()
    assert not (copied / "yaml").exists() and not (copied / "json.py").exists()


def test_a_rollout_function_renders_with_its_module_copied(hpcrl, project):
    run_dir = _render(hpcrl, _recipe(project, ROLLOUT))
    spec = json.loads((run_dir / rundir.SPEC_FILE).read_text())
    assert spec["recipe"]["agent"]["rollout_func"] == "my_rollouts.run"
    assert spec["reward_modules"] == [str(project / "my_tools.py"), str(project / "my_rollouts.py")]
    assert (run_dir / rundir.REWARDS_DIR / "my_rollouts.py").read_text() == MY_ROLLOUTS


def test_a_rollout_function_beside_tools_and_an_environment_renders(hpcrl, project, tmp_path):
    """TRL runs its tool loop over a rollout function's completions; so does hpcrl (the pair's
    rollouts: tests/compute/agents/test_tool_loop_matches_trl.py)."""
    run_dir = _render(hpcrl, f"--run-dir={tmp_path / 'pair'}", _recipe(project, GOOD),
                      "agent.rollout_func=my_rollouts.run")
    agent = json.loads((run_dir / rundir.SPEC_FILE).read_text())["recipe"]["agent"]
    assert (agent["rollout_func"], agent["environment_factory"]) == ("my_rollouts.run", "my_env.Wordle")
    assert (run_dir / rundir.REWARDS_DIR / "my_rollouts.py").read_text() == MY_ROLLOUTS


@pytest.mark.parametrize("source,problem", [
    ("def f(prompts, trainer): ...", None),
    ("def f(prompts, trainer=None, *, retries=2, **kwargs): ...", None),
    ("def f(*args): ...", None),
    ("def f(prompts, /, trainer): ...", None),
    ("@functools.wraps(g)\ndef f(prompts): ...", None),         # a decorator may change the signature
    ("def f(): ...", "it takes 0 positional arguments, not two"),
    ("def f(prompts, trainer, env, *, seed=0): ...", "it takes 3 positional arguments without defaults, not two"),
])
def test_a_rollout_function_is_callable_as_trl_calls_it(source, problem):
    assert agent_inputs.rollout_func_problem(ast.parse(source).body[0]) == problem


def test_the_agent_demo_model_renders_tools(hpcrl, project, tmp_path):
    _render(hpcrl, f"--run-dir={tmp_path / 'agent-demo'}", _recipe(project, GOOD), "model.path=demo:tiny:agent")


def test_the_agent_demo_recipe_renders_from_the_repository(hpcrl, tmp_path):
    """examples/agent.yaml, as its comment says to run it: from the repository's root."""
    from conftest import REPO

    run_dir = _render(hpcrl, f"--run-dir={tmp_path / 'agent'}", "examples/agent.yaml", cwd=REPO)
    spec = json.loads((run_dir / rundir.SPEC_FILE).read_text())
    recipe = spec["recipe"]
    assert recipe["model"]["path"] == "demo:tiny:agent"
    assert recipe["agent"]["tools"] == ["calculator_tools.calculator"]
    assert recipe["data"]["path"] == str(REPO / "examples" / "calculator_tasks.jsonl")
    assert recipe["rewards"][0]["func"] == "calculator_rewards.correct"
    assert sorted(p.name for p in (run_dir / rundir.REWARDS_DIR).iterdir()) == \
        ["calculator_rewards.py", "calculator_tools.py"]


def test_environments_by_name_and_a_factory_function_render(hpcrl, project, tmp_path):
    _render(hpcrl, f"--run-dir={tmp_path / 'by-name'}", _recipe(project, GOOD),
            "agent.environment_factory={wordle: my_env.Wordle, sudoku: 'my_env:Sudoku'}")
    # A function's environment is the job's to see: its rewards are named, so nothing is missing.
    _render(hpcrl, f"--run-dir={tmp_path / 'function'}", _recipe(project, GOOD),
            "agent.environment_factory=my_env.make_wordle", "rewards=[my_tools.calculator]")


def test_a_trl_configuration_with_agent_keys_translates(project, monkeypatch):
    monkeypatch.chdir(project)
    path = project / "trl.yaml"
    path.write_text("model_name_or_path: ./model\ndataset_name: ./tasks.jsonl\n"
                    "tools: [my_tools.calculator, my_tools.search_notes]\n"
                    "environment_factory: {wordle: my_env.Wordle, sudoku: my_env.Sudoku}\n"
                    "max_tool_calling_iterations: 4\nlearning_rate: 1.0e-5\n")
    resolved = compose.build_recipe(str(path))
    r, t = resolved.recipe, resolved.trl
    assert r.agent.tools == ("my_tools.calculator", "my_tools.search_notes")
    assert r.agent.environment_factory == {"wordle": "my_env.Wordle", "sudoku": "my_env.Sudoku"}
    assert r.grpo.max_tool_calling_iterations == 4 and r.rewards == () and r.agent.enabled
    assert (t.moved["tools"], t.moved["environment_factory"], t.moved["max_tool_calling_iterations"]) == \
        ("agent.tools", "agent.environment_factory", "grpo.max_tool_calling_iterations")
    # A single tool as a string, and TRL's default (none) for the others, change nothing else.
    path.write_text("model_name_or_path: ./model\ndataset_name: ./tasks.jsonl\ntools: my_tools.calculator\n"
                    "environment_factory: null\nreward_funcs: [my_tools.calculator]\n")
    resolved = compose.build_recipe(str(path))
    assert resolved.recipe.agent.tools == ("my_tools.calculator",) and resolved.recipe.agent.environment_factory == ""
    assert "environment_factory" in resolved.trl.inert
    # TRL's rollout_func: agent.rollout_func.
    path.write_text("model_name_or_path: ./model\ndataset_name: ./tasks.jsonl\nrollout_func: my_rollouts.run\n"
                    "reward_funcs: [my_tools.calculator]\n")
    resolved = compose.build_recipe(str(path))
    assert resolved.recipe.agent.rollout_func == "my_rollouts.run" and not resolved.recipe.agent.enabled
    assert resolved.trl.moved["rollout_func"] == "agent.rollout_func"


def test_hpcrl_recipe_shows_the_agent_section(hpcrl, project):
    r = hpcrl("recipe", "--json", _recipe(project, GOOD))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["recipe"]
    assert out["agent"]["tool_workers"] == 4 and out["grpo"]["max_tool_calling_iterations"] == 4


def test_the_demo_rewards_stay_the_default_of_a_recipe_that_is_no_agent():
    assert build(Recipe, expand_shorthands({})).rewards == Recipe().rewards != ()
    agent = build(Recipe, expand_shorthands({"agent": {"environment_factory": "my_env.Wordle"}}))
    assert agent.rewards == () and agent.agent.enabled and agent.agent.factories() == {None: "my_env.Wordle"}
    with pytest.raises(UserError, match=r"^rewards: at least one reward function is required"):
        build(Recipe, expand_shorthands({"agent": {"tools": ["my_tools.calculator"]}}))


def test_the_environment_column_is_read_as_the_prompts_are(tmp_path):
    column = data_rows.NamesColumn("environment", ("wordle", "sudoku"), "agent.environment_factory")
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "x", "environment": 3}) + "\n")
    data_rows.check_prompts([bad], data_rows.RowChecks("prompt"), "data.path")      # prompts only
    both = data_rows.RowChecks("prompt", (column,))
    data_rows.check_prompts([good], both, "data.path")
    with pytest.raises(UserError, match=r'bad.jsonl line 2: column "environment" is 3, not one of'):
        data_rows.check_prompts([bad], both, "data.path")


# ---------------------------------------------------------------------------- get_json_schema's verdicts
SCHEMA_CASES = '''
from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union


def plain(x: int, y: float = 1.0) -> str:
    """Adds.

    Args:
        x: the first
        y: the second,
            on two lines
    """


def no_docstring(x: int) -> int:
    return x


def no_hint(x, y: int) -> int:
    """Adds.

    Args:
        x: the first
        y: the second
    """


def no_args_section(x: int) -> int:
    """Adds x."""


def typed_google_style(x: int) -> int:
    """Adds.

    Args:
        x (int): the first
    """


def unions_and_literals(a: int | None, b: Optional[list[str]], c: Literal["x", "y", -1], d: dict[str, Any],
                        e: tuple[int, str], f: "list[dict[str, float]]") -> Union[int, str]:
    """Everything transformers describes.

    Args:
        a: one
        b: two
        c: three (choices: ["x", "y", -1])
        d: four
        e: five
        f: six
    """


def a_set(x: set[int]) -> int:
    """Counts.

    Args:
        x: the numbers
    """


def one_element_tuple(x: tuple[int]) -> int:
    """Counts.

    Args:
        x: the numbers
    """


def open_tuple(x: tuple[int, ...]) -> int:
    """Counts.

    Args:
        x: the numbers
    """


def callable_argument(f: Callable[[int], int]) -> int:
    """Calls.

    Args:
        f: the function
    """


def set_returned(x: int) -> set[int]:
    """Makes a set.

    Args:
        x: the size
    """


def unhinted_kwargs(x: int, **kwargs) -> int:
    """Adds.

    Args:
        x: the first
    """


def bad_choices(x: str) -> str:
    """Picks.

    Args:
        x: one of them (choices: [tea, coffee])
    """


async def asynchronous(query: str, limit: int = 3) -> list[str]:
    """Searches.

    Args:
        query: the words
        limit: at most this many
    """


def no_arguments() -> str:
    """Tells the time."""


def receiver_first(self, query: str) -> str:
    """Searches.

    Args:
        query: the words
    """


class Environment:
    def reset(self):
        pass

    def good(self, word: str) -> str:
        """Guesses.

        Args:
            word: the guess
        """

    def unhinted(self, word) -> str:
        """Guesses.

        Args:
            word: the guess
        """

    def undescribed(self, word: str, times: int) -> str:
        """Guesses.

        Args:
            word: the guess
        """

    @staticmethod
    def static(word: str) -> str:
        """Guesses.

        Args:
            word: the guess
        """

    @staticmethod
    def static_undescribed(word: str) -> str:
        """Guesses."""
'''


def test_the_tool_check_agrees_with_get_json_schema(tmp_path):
    from transformers.utils import get_json_schema

    file = tmp_path / "schema_cases.py"
    file.write_text(SCHEMA_CASES)
    spec = importlib.util.spec_from_file_location("schema_cases", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tree = ast.parse(SCHEMA_CASES)
    cases = [(node.name, node, getattr(module, node.name), False) for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    env = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    instance = module.Environment()
    cases += [(f"Environment.{node.name}", node, getattr(instance, node.name),
               not any(getattr(d, "id", "") == "staticmethod" for d in node.decorator_list))
              for node in env.body if isinstance(node, ast.FunctionDef) and node.name != "reset"]
    verdicts = {}
    for name, node, func, method in cases:
        try:
            get_json_schema(func)
            accepted = True
        except Exception:                   # noqa: BLE001 - any refusal of transformers', whatever its type
            accepted = False
        problem = agent_inputs.function_problem(node, method=method)
        verdicts[name] = (accepted, problem)
        assert accepted == (problem is None), (name, problem)
    # Both verdicts occur, so that the agreement means something.
    assert sum(a for a, _ in verdicts.values()) >= 6 and sum(not a for a, _ in verdicts.values()) >= 8, verdicts
    assert agent_inputs.tool_problem(file, "plain") is None
    assert agent_inputs.tool_problem(file, "no_hint") == "argument 'x' has no type hint"
