"""Reward functions as TRL 1.16 calls them (issue 12): trainer_state, log_extra and log_metric reach
them, log_metric's values land in metrics.jsonl averaged over the trainers and in the plot; TRL's
own helpers by name, factories with kwargs, and a reward module beside the recipe, copied into the
run directory and imported from there."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO
from dist_harness import spawn

from hpcrl.compute.inference.types import Completion
from hpcrl.compute.train import rewards
from hpcrl.job import rundir
from hpcrl.job.config import build, to_dict
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import TRL_REWARDS, TRL_REWARDS_MATH_VERIFY, Recipe, expand_shorthands

CONV = [[{"role": "user", "content": "1/3?"}]] * 2


# ------------------------------------------------------------------ TRL's helpers, factories
def test_trl_reward_names_are_trl_rewards():
    from trl.rewards import accuracy_rewards

    assert set(TRL_REWARDS) == {n for names in sys.modules["trl.rewards"]._import_structure.values() for n in names}
    assert set(TRL_REWARDS_MATH_VERIFY) <= {n for n in dir(accuracy_rewards) if not n.startswith("_")}


def test_trl_names_resolve_and_factories_get_trl_clis_defaults():
    funcs = rewards.load_reward_functions(["think_format_reward", {"func": "get_soft_overlong_punishment"},
                                          {"func": "trl.rewards.get_repetition_penalty_reward", "name": "rep"}])
    assert [f.name for f in funcs] == ["think_format_reward", "soft_overlong_punishment_reward", "rep"]
    # TRL's CLI makes it with max_completion_len=1280, soft_punish_cache=256: 1100 tokens are 76 into the zone.
    scores = rewards.score_completions(funcs, CONV, rewards.as_completions(CONV, ["a b", "a a a a"]),
                                       completion_ids=[[1] * 1100, [1]])
    assert scores[:, 1].tolist() == pytest.approx([-76 / 256, 0.0])


def test_accuracy_reward_scores_and_logs_its_columns():
    pytest.importorskip("math_verify")
    funcs = rewards.load_reward_functions(["accuracy_reward"])
    log = rewards.RewardLog()
    completions = rewards.as_completions(CONV, [r"It is \boxed{\frac{1}{3}}", r"It is \boxed{\frac{1}{2}}"])
    scores = rewards.score_completions(funcs, CONV, completions, [[1], [2]], {"solution": [r"\frac{1}{3}"] * 2},
                                       trainer_state=None, log_extra=log.log_extra, log_metric=log.log_metric)
    assert scores[:, 0].tolist() == [1.0, 0.0]
    assert set(log.extra) == {"solution", "gold_parsed", "answer_parsed"} and len(log.extra["answer_parsed"]) == 2


def test_factory_kwargs_errors_name_the_field():
    with pytest.raises(ValueError) as err:
        rewards.load_reward_functions(["think_format_reward", {"func": "get_soft_overlong_punishment",
                                                               "kwargs": {"max_len": 3}}])
    msg = str(err.value)
    assert msg.startswith("rewards[1].kwargs: get_soft_overlong_punishment(**{'max_len': 3}) failed (TypeError: ")
    assert "\n" not in msg
    with pytest.raises(ValueError, match=r"not a number"):
        rewards.RewardLog().log_metric("x", "high")


# ------------------------------------------------------------------ the recipe
def test_recipe_rewards_take_strings_kwargs_and_names():
    recipe = build(Recipe, expand_shorthands({"rewards": ["think_format_reward", {
        "func": "get_soft_overlong_punishment", "kwargs": {"max_completion_len": 8, "soft_punish_cache": 2},
        "name": "overlong", "weight": 0.5}]}))
    a, b = recipe.rewards
    assert (a.func, a.kwargs, a.name) == ("think_format_reward", None, "")
    assert (b.kwargs, b.name, b.weight) == ({"max_completion_len": 8, "soft_punish_cache": 2}, "overlong", 0.5)
    assert build(Recipe, to_dict(recipe)) == recipe                                   # job.json keeps them
    assert build(Recipe, expand_shorthands({"rewards": "accuracy_reward"})).rewards[0].func == "accuracy_reward"
    with pytest.raises(UserError, match=r'rewards\[0\].func: .* \(did you mean "think_format_reward"\?\)'):
        build(Recipe, expand_shorthands({"rewards": ["think_format"]}))


def test_missing_math_verify_is_refused_on_the_login_side(monkeypatch):
    from hpcrl.login import compose

    monkeypatch.setattr(compose, "_importable", lambda top: top != "math_verify")
    recipe = build(Recipe, expand_shorthands({"rewards": ["think_format_reward", "trl.rewards:accuracy_reward"]}))
    with pytest.raises(UserError) as err:
        compose._reward_modules(recipe, None, check_installed=True)
    assert str(err.value).startswith("rewards[1].func: trl.rewards:accuracy_reward needs the math_verify package")
    assert "pip install math-verify" in str(err.value)
    assert compose._reward_modules(recipe, None, check_installed=False) == ()     # another interpreter: its own


# ------------------------------------------------------------------ a module beside the recipe
MY_REWARDS = "def correct(completions, **kwargs):\n    return [{value}] * len(completions)\n"


def _render(hpcrl, *args, cwd: Path | None = None) -> Path:
    r = hpcrl("render", "--site", "testbed", *args, **({"cwd": cwd} if cwd else {}))
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())


def _load_from(run_dir: Path, func: str, monkeypatch) -> float:
    """The trainers' import of `func`, from the run directory's copies, scored on one completion."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.split(".")[0] in ("my_rewards", "my_pkg")]:
        monkeypatch.delitem(sys.modules, name)
    (f,) = rewards.load_reward_functions([func], module_dir=run_dir / rundir.REWARDS_DIR)
    return f.func(completions=["x"])[0]


def test_module_beside_the_recipe_is_copied_and_imported_from_the_run_dir(hpcrl, tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "my_pkg" / "__pycache__").mkdir(parents=True)
    (project / "my_rewards.py").write_text(MY_REWARDS.format(value=1.0))
    (project / "my_pkg" / "__init__.py").write_text("")
    (project / "my_pkg" / "scores.py").write_text(MY_REWARDS.format(value=2.0))
    (project / "my_pkg" / "__pycache__" / "stale.pyc").write_bytes(b"")
    recipe = project / "recipe.yaml"
    recipe.write_text("rewards: ['my_rewards:correct', {func: my_pkg.scores:correct, weight: 0.5}, think_format_reward]\n")
    run_dir = _render(hpcrl, recipe)
    spec = json.loads((run_dir / rundir.SPEC_FILE).read_text())
    assert spec["reward_modules"] == [str(project / "my_rewards.py"), str(project / "my_pkg")]
    copies = run_dir / rundir.REWARDS_DIR
    assert sorted(str(p.relative_to(copies)) for p in copies.rglob("*")) == [
        "my_pkg", "my_pkg/__init__.py", "my_pkg/scores.py", "my_rewards.py"]
    # The job imports what was submitted, whatever happens to the originals after.
    (project / "my_rewards.py").write_text(MY_REWARDS.format(value=9.0))
    assert _load_from(run_dir, "my_rewards:correct", monkeypatch) == 1.0
    assert _load_from(run_dir, "my_pkg.scores:correct", monkeypatch) == 2.0


def test_module_in_the_current_directory_is_copied(hpcrl, tmp_path):
    (hpcrl.work / "my_rewards.py").write_text(MY_REWARDS.format(value=1.0))
    recipe = tmp_path / "elsewhere" / "recipe.yaml"
    recipe.parent.mkdir()
    recipe.write_text("rewards: ['my_rewards:correct']\n")
    run_dir = _render(hpcrl, recipe)
    assert (run_dir / rundir.REWARDS_DIR / "my_rewards.py").read_text() == MY_REWARDS.format(value=1.0)


def test_installed_packages_and_plain_directories_are_not_copied(hpcrl, tmp_path):
    # A directory named like the module, without __init__.py, is no module: nothing is copied whole.
    (hpcrl.work / "my_rewards").mkdir()
    r = hpcrl("render", "--site", "testbed", "rewards=[my_rewards:correct]")
    assert r.returncode == 2 and "rewards[0].func: no module named 'my_rewards'" in r.stderr
    # From hpcrl's checkout, the demo's rewards come from the installed hpcrl, not a copy of the checkout.
    run_dir = _render(hpcrl, f"--run-dir={tmp_path / 'demo-run'}", cwd=REPO)
    assert json.loads((run_dir / rundir.SPEC_FILE).read_text())["reward_modules"] == []
    assert not (run_dir / rundir.REWARDS_DIR).exists()


# ------------------------------------------------------------------ the trainer: what reaches the functions
CONTRACT_REWARDS = '''
CALLS = []


def probe(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns):
    import torch.distributed as dist

    rank = dist.get_rank()
    CALLS.append(dict(n=len(completions), columns=sorted(columns), state=trainer_state,
                      ids=[len(c) for c in completion_ids]))
    log_metric("probe/rank", float(rank))
    log_metric("probe/rank", float(rank) + 1)
    if rank == 1:
        log_metric("probe/only_rank1", 7.0)
    log_extra("seen_rank", [rank] * len(completions))
    return [float(len(c)) for c in completion_ids]


def make(bonus):
    def bonus_reward(completions, **kwargs):
        return [bonus] * len(completions)
    return bonus_reward
'''


class _Fixed:
    """Completions of 2 and 3 tokens, alternating."""

    version = 0

    def submit(self, prompts, sampling):
        out = [Completion(i, (5, 6, 7)[:2 + j % 2], (), "7", False, self.version)
               for i in range(len(prompts)) for j in range(sampling.n)]
        return SimpleNamespace(result=lambda: out)

    def push_weights(self, model, version):
        self.version = version
        return {}


def _w_contract(rank, world, model_dir, run_dir):
    from transformers import AutoModelForCausalLM, TrainerState

    from hpcrl.compute.metrics import MetricsWriter
    from hpcrl.compute.train.sources import load_dataset, load_tokenizer
    from hpcrl.compute.train.trainer import Trainer, TrainerSetup
    from hpcrl.job.recipe import GRPOConfig, RewardSpec

    grpo = GRPOConfig(learning_rate=1e-3, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      beta=0.0, max_steps=3, seed=0, vllm_importance_sampling_correction=False,
                      gradient_checkpointing=False)
    recipe = Recipe(grpo=grpo, rewards=(RewardSpec("contract_rewards:probe", name="probe"),
                                        RewardSpec("contract_rewards:make", 0.5, kwargs={"bonus": 0.25})))
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    writer = MetricsWriter(run_dir, rank)
    setup = TrainerSetup(
        recipe=recipe, run_dir=Path(run_dir), device=torch.device("cpu"), policy=policy, reference=None,
        tokenizer=load_tokenizer(recipe.model, model_dir), dataset=load_dataset(recipe.data, grpo.seed),
        trainer_rank=rank, num_trainers=world, log=lambda line: None, collective_timeout_s=60,
        on_metrics=writer.log if rank == 0 else None)
    trainer = Trainer(setup, _Fixed())
    assert [f.name for f in trainer.rewards] == ["probe", "bonus_reward"]
    trainer._train_on(trainer._next_generation(), 0.0)
    trainer._train_on(trainer._next_generation(), 0.0)
    writer.close()

    import contract_rewards     # the copy in <run_dir>/rewards, which the trainer imported

    assert contract_rewards.__file__ == str(Path(run_dir) / rundir.REWARDS_DIR / "contract_rewards.py")
    first, second = contract_rewards.CALLS
    assert first["n"] == 4 and first["ids"] == [2, 3, 2, 3] and "answer" in first["columns"]
    state = first["state"]
    assert isinstance(state, TrainerState) and state is second["state"]         # one object, as TRL's self.state
    assert (state.global_step, state.max_steps, state.is_world_process_zero) == (1, 3, rank == 0)
    # 2 prompts per rank and step of the demo's 2000: the second scoring is 4/2000 of an epoch in.
    assert state.epoch == pytest.approx(4 / 2000) and state.num_train_epochs == 1
    assert state.num_input_tokens_seen > 2 * 2 * 10      # both generations' prompts and completions, both ranks
    assert trainer.completion_extra == {"seen_rank": [rank] * 4}
    if rank == 0:
        lines = [json.loads(line) for line in (Path(run_dir) / rundir.METRICS_FILE).read_text().splitlines()]
        assert [m["step"] for m in lines] == [1, 2]
        for m in lines:
            # Mean over each call on each rank (0, 1 on rank 0; 1, 2 on rank 1), as TRL's.
            assert m["probe/rank"] == 1.0 and m["probe/only_rank1"] == 7.0, m
            assert m["log_metric_names"] == ["probe/only_rank1", "probe/rank"]
            assert m["rewards/probe/mean"] == 2.5 and m["rewards/bonus_reward/mean"] == 0.25


def test_trainer_gives_reward_functions_state_and_loggers(tmp_path):
    from hpcrl.compute.models.tiny import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "tiny", size="tiny", seed=0))
    run_dir = tmp_path / "run"
    (run_dir / rundir.REWARDS_DIR).mkdir(parents=True)
    (run_dir / rundir.REWARDS_DIR / "contract_rewards.py").write_text(CONTRACT_REWARDS)
    spawn(_w_contract, tmp_path, model_dir, str(run_dir), timeout=240)


# ------------------------------------------------------------------ the plot
def test_plot_draws_what_reward_functions_logged(tmp_path):
    pytest.importorskip("matplotlib")
    from hpcrl.login import plot

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "reward": 0.1 * s, "completion_len_mean": 5.0} for s in (1, 2, 3)]
    plain = plot.write_plot(_with_metrics(run_dir, lines), tmp_path / "plain.png")
    for rec in lines:
        rec.update({"log_metric_names": ["curriculum/level"], "curriculum/level": rec["step"] // 2})
    logged = plot.write_plot(_with_metrics(run_dir, lines), tmp_path / "logged.png")
    assert plot.logged_metric_names(plot.load_steps(run_dir)) == ["curriculum/level"]
    import matplotlib.image

    assert matplotlib.image.imread(str(logged)).shape[0] > matplotlib.image.imread(str(plain)).shape[0]


def _with_metrics(run_dir: Path, lines: list[dict]) -> Path:
    (run_dir / rundir.METRICS_FILE).write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    return run_dir


def _named(func):
    return rewards.RewardFunction(name=func.__name__, func=func, weight=1.0)


async def _async_raises(prompts, completions, **kwargs):
    raise KeyError("answer")


@pytest.mark.parametrize("func, message", [
    (lambda prompts, completions, **kw: 0.5, "reward function '<lambda>' returned 0.5, not a list of 2 rewards"),
    (lambda prompts, completions, **kw: [1.0, "good"], "reward function '<lambda>' returned 'good' among its rewards"),
    (lambda prompts, completions, **kw: 1 / 0, "reward function '<lambda>' raised ZeroDivisionError: division by zero"),
    (_async_raises, "reward function '_async_raises' raised KeyError: 'answer'"),
])
def test_a_reward_that_fails_is_named_with_what_it_did(func, message):
    """Issue #26, item 8: a reward that raises or returns a scalar is named, in the run's last line too."""
    from hpcrl.compute.launch.reason import explain

    with pytest.raises(rewards.RewardError) as e:
        rewards.score_completions([_named(func)], ["p", "q"], ["a", "b"])
    assert str(e.value).startswith(message) and explain(e.value).startswith(message)
