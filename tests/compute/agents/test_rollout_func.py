"""TRL's rollout_func (agent.rollout_func, issue #30): a user's function, written as TRL users write
them, makes the rollouts; hpcrl gives it a `trainer` and trains on what it returns.

The training run: 2 gloo trainer ranks, a scripted generator standing in for the node's engines,
two generations ahead with weights taken in flight (a push lands between two turns of a call); the
function plays a two-turn game through
trainer.vllm_generation.vllm_client (a guess, the environment's feedback, a second guess), so its
rows hold tokens the environment put there (env_mask 0: attended to, no loss) and an environment
reward that reaches the reward function as an extra field. The other tests check the one-line refusals of what cannot be trained on, the `trainer`
attributes hpcrl does not offer, and that the client's answer has the shape TRL's VLLMClient gives.
"""

from __future__ import annotations

import re
import textwrap
import threading
import types

import pytest
from dist_harness import spawn
from support import tool_tokenizer

from hpcrl.compute.inference.types import Completion, Generated, Sampling
from hpcrl.job.recipe import GRPOConfig

# The user's module, in the style of TRL's OpenEnv examples (wordle.py's rollout_once): one episode
# per prompt it is given, its own prompt (a system message added), the environment's feedback between
# the turns masked out with env_mask, the environment's reward and a constant as extra fields.
ROLLOUTS = textwrap.dedent('''
    import re

    SYSTEM = {"role": "system", "content": "You are a calculator."}


    def _turn(trainer, prompt_ids):
        out = trainer.vllm_generation.vllm_client.generate(
            prompts=[prompt_ids], n=1, max_tokens=trainer.max_completion_length // 2,
            temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k,
            repetition_penalty=trainer.repetition_penalty, generation_kwargs=trainer.args.generation_kwargs)
        return out["completion_ids"][0], [lp[0] for lp in out["logprobs"][0]]


    def rollout_func(prompts, trainer):
        tok = trainer.processing_class
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "env_reward": [],
               "source": "game"}
        for prompt in prompts:
            text = tok.apply_chat_template([SYSTEM] + prompt, add_generation_prompt=True, tokenize=False,
                                           **trainer.chat_template_kwargs)
            prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
            a, b = map(int, re.findall(r"(\\d)\\+(\\d)=", prompt[-1]["content"])[0])
            first, first_lps = _turn(trainer, prompt_ids)
            right = str(a + b) in tok.decode(first)
            feedback = tok("\\nRight.\\n" if right else "\\nWrong, again.\\n", add_special_tokens=False)["input_ids"]
            second, second_lps = _turn(trainer, prompt_ids + first + feedback)
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(first + feedback + second)
            out["logprobs"].append(first_lps + [0.0] * len(feedback) + second_lps)
            out["env_mask"].append([1] * len(first) + [0] * len(feedback) + [1] * len(second))
            out["env_reward"].append(1.0 if right else 0.0)
        return out
''')

REWARDS = textwrap.dedent('''
    def env(completions, env_reward, source, **kwargs):
        assert set(source) == {"game"}, source
        return env_reward
''')


class GuessingGenerator:
    """The node's engines, scripted: "The answer is <digit>" and the end of the turn, the digit from the
    request's seed, the prompt and the completion's place in its group (so a group's rewards differ)."""

    def __init__(self, tok):
        self.tok, self.version, self.asked = tok, 0, []

    def push_weights(self, model, version: int) -> dict:
        self.version = version
        return {}

    def submit(self, prompts, sampling: Sampling) -> Generated:
        self.asked.append(sampling)
        out = []
        for k, p in enumerate(prompts):
            for j in range(sampling.n):
                digit = ((sampling.seed or 0) + len(p) + j) % 10
                ids = self.tok(f"The answer is {digit}<|im_end|>", add_special_tokens=False)["input_ids"]
                ids = ids[:sampling.max_tokens]
                out.append(Completion(k, tuple(ids), tuple(-0.1 * (1 + i % 5) for i in range(len(ids))),
                                      self.tok.decode(ids, skip_special_tokens=True), False, self.version))
        return Generated(out)


def _dataset():
    import datasets

    pairs = [(3, 4), (5, 2), (1, 6), (2, 2)]
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs],
                                       "answer": [str(a + b) for a, b in pairs]})


class PushInsideACall(GuessingGenerator):
    """The scripted engines, whose 10th request (the second turn of the first rollout of the
    generation asked for ahead, rolled out while the trainer trains) waits up to 60 s for a weight
    push: in flight the push does not wait for the call, so it lands between that rollout's turns."""

    def __init__(self, tok):
        super().__init__(tok)
        self.pushes = 0
        self.pushed = threading.Condition()

    def push_weights(self, model, version: int) -> dict:
        with self.pushed:
            self.pushes += 1
            self.pushed.notify_all()
        return super().push_weights(model, version)

    def submit(self, prompts, sampling: Sampling) -> Generated:
        if len(self.asked) == 9:
            with self.pushed:
                self.pushed.wait_for(lambda: self.pushes > 0, 60)
        return super().submit(prompts, sampling)


def _w_train(rank, world, model_dir, run_dir):
    from pathlib import Path

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.agents.rollout_func import RolloutFunction
    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train import trainer as trainer_mod
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.job import metric_keys as mk
    from hpcrl.job import rundir
    from hpcrl.job.agent_config import AgentConfig
    from hpcrl.job.recipe import InferenceConfig, LoggingConfig, Recipe, RewardSpec
    from support import cpu_trainer_setup, spy_on_packing

    ckpt.control_group(60)
    modules = Path(run_dir) / rundir.REWARDS_DIR
    if rank == 0:
        modules.mkdir(parents=True, exist_ok=True)
        (modules / "game_rollouts.py").write_text(ROLLOUTS)
        (modules / "game_rewards.py").write_text(REWARDS)
    torch.distributed.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    grpo = GRPOConfig(learning_rate=1e-3, per_device_train_batch_size=4, num_generations=4, max_completion_length=32,
                      max_steps=2, seed=0, gradient_checkpointing=False, eval_strategy="steps", eval_steps=2,
                      per_device_eval_batch_size=4)
    # Two generations ahead, weights taken in flight: the function runs in its thread while the
    # trainer trains on the generation before, and a push does not wait for the call under way.
    recipe = Recipe(grpo=grpo, agent=AgentConfig(rollout_func="game_rollouts.rollout_func"),
                    rewards=(RewardSpec("game_rewards:env"),), logging=LoggingConfig(log_completions=1),
                    inference=InferenceConfig(max_staleness=2, weight_update="in_flight"))
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    packed = spy_on_packing(trainer_mod)
    metrics, rows = [], []
    tok = tool_tokenizer()
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world, tokenizer=tok,
                              dataset=_dataset(), eval_dataset=_dataset(),
                              on_metrics=lambda step, m: metrics.append(m), on_completions=rows.extend)
    generator = PushInsideACall(tok)
    trainer = trainer_mod.Trainer(setup, generator)
    assert isinstance(trainer.rollouts, RolloutFunction)
    try:
        assert trainer.run() == "finished"
    finally:
        trainer.rollouts.close()
    # Two turns per rollout, each its own request of the engines, with the recipe's sampling and its own seed.
    assert len(generator.asked) >= 2 * 4 and len({s.seed for s in generator.asked}) == len(generator.asked)
    assert {(s.n, s.max_tokens, s.temperature) for s in generator.asked} == {(1, 16, 1.0)}
    # The function's prompt ids are trained on (its system message), and the feedback takes no loss.
    for prompt_ids, loss, attended in packed:
        assert all("You are a calculator." in tok.decode(p) for p in prompt_ids)
        assert 0 < loss < attended, (loss, attended)
    # The push landed inside the second generation's first rollout: its second turn's tokens carry
    # the new version, its first turn's the old one, and the step that trained on it counts it.
    assert generator.pushes >= 1 and [m[mk.UPDATED_IN_FLIGHT] for m in metrics][:2] == [0.0, 0.25], metrics
    assert max(m[mk.STALENESS_MAX] for m in metrics) <= 2
    if rank != 0:
        return
    last = metrics[-1]
    # The environment's reward reached the reward function as an extra field, in training and in evaluation.
    assert mk.reward_mean("env") in last and "eval_reward" in last, last
    # A group's rollouts differ in reward: the advantages carry a signal.
    assert any(m[mk.FRAC_REWARD_ZERO_STD] < 1 for m in metrics), metrics
    # Completion lengths count the model's tokens only, as TRL's with env_mask.
    assert all(m[mk.COMPLETIONS_MAX_LENGTH] <= 2 * 6 for m in metrics if mk.COMPLETIONS_MAX_LENGTH in m), metrics
    assert any("Wrong, again." in r["completion"] or "Right." in r["completion"] for r in rows), rows[0]


def test_a_trl_rollout_function_trains(model_dir, tmp_path):
    spawn(_w_train, tmp_path, model_dir, str(tmp_path / "run"), timeout=300)


# ---------------------------------------------------------------------------- what is refused, in one line
def _rollouts(func, tok=None, **grpo):
    from hpcrl.compute.agents.rollout_func import RolloutFunction

    tok = tok or tool_tokenizer()
    return RolloutFunction(func, "my_rollouts.run", GuessingGenerator(tok), tok,
                           GRPOConfig(num_generations=2, max_completion_length=8, **grpo))


def _batch(prompts=("1+2=", "3+4=")):
    from hpcrl.compute.train.data import PromptBatch

    return PromptBatch(list(prompts), list(prompts), [[5, 6, 7]] * len(prompts), {"answer": ["3", "7"]}, [0, 1])


def _run(func, **grpo):
    rollouts = _rollouts(func, **grpo)
    try:
        rows, pending = rollouts.submit(_batch(), Sampling(n=2, max_tokens=8, seed=1))
        return rows, pending.result()
    finally:
        rollouts.close()


def _one_per_prompt(prompts, trainer, **changes):
    """A correct answer: one generation through the client per prompt it was given."""
    out = trainer.vllm_generation.vllm_client.generate(prompts=prompts, n=1, max_tokens=5)
    return {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"],
            "logprobs": [[lp[0] for lp in row] for row in out["logprobs"]], **changes}


def test_the_rows_carry_the_functions_ids_extra_fields_and_the_engines_version():
    rows, completions = _run(lambda prompts, trainer: _one_per_prompt(prompts, trainer, turns=[1, 2, 3, 4],
                                                                        game="sums"))
    tok = tool_tokenizer()
    assert rows.prompts == ["1+2=", "1+2=", "3+4=", "3+4="]
    assert rows.prompt_ids == [tok("1+2=")["input_ids"]] * 2 + [tok("3+4=")["input_ids"]] * 2
    assert rows.columns == {"answer": ["3", "3", "7", "7"], "turns": [1, 2, 3, 4], "game": ["sums"] * 4}
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1]
    assert all(c.weight_version == 0 and c.text.startswith("The answer is") for c in completions)
    # Cut at max_tokens=5 before the end of the turn: truncated, by TRL's rule for these rows.
    assert all(c.truncated and c.tool_mask == (1,) * 5 for c in completions)


BAD_OUTPUTS = [
    ("too-few-rows", lambda p, t: {k: v[:2] for k, v in _one_per_prompt(p, t).items()},
     "agent.rollout_func (my_rollouts.run) returned 2 rows of prompt_ids, expected 4: one per prompt it was given "
     "(2 prompts x 2 generations, each prompt 2 times in a row)"),
    ("missing-logprobs", lambda p, t: {k: v for k, v in _one_per_prompt(p, t).items() if k != "logprobs"},
     "agent.rollout_func (my_rollouts.run): rollout_func must return keys ['logprobs'] in its output dict"),
    ("not-a-dict", lambda p, t: [_one_per_prompt(p, t)],
     "agent.rollout_func (my_rollouts.run) returned list, not a dict with prompt_ids, completion_ids, logprobs"),
    ("short-extra-field", lambda p, t: _one_per_prompt(p, t, score=[1.0]),
     "agent.rollout_func (my_rollouts.run) returned 1 values of 'score', expected 4 (one per row"),
    ("taken-name", lambda p, t: _one_per_prompt(p, t, completions=["x"] * 4),
     "agent.rollout_func (my_rollouts.run) returned 'completions', a name reward functions already get"),
    ("mask-length", lambda p, t: _one_per_prompt(p, t, env_mask=[[1]] * 4),
     "agent.rollout_func (my_rollouts.run): env_mask[0] has 1 entries for 5 completion tokens (one each)"),
    ("nested-logprobs", lambda p, t: {**_one_per_prompt(p, t), "logprobs": [[[-0.1]] * 5] * 4},
     "agent.rollout_func (my_rollouts.run): logprobs[0] holds [[-0.1], [-0.1], [-0.1], [-0.1], [-0.1]]: one "
     "log-probability per token (the client's logprobs hold [logprob] per token: take lp[0])"),
    ("no-generation", lambda p, t: {"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4},
     "agent.rollout_func (my_rollouts.run) returned rows without generating through its trainer"),
    ("raises", lambda p, t: t.accelerator.device,
     "agent.rollout_func (my_rollouts.run) raised AttributeError: trainer.accelerator: hpcrl calls a rollout "
     "function beside its own trainer, and the `trainer` it gets offers only processing_class, args,"),
    ("unknown-arg", lambda p, t: t.args.vllm_server_host,
     "raised AttributeError: trainer.args.vllm_server_host: not a field of hpcrl's grpo section"),
    ("top-logprobs", lambda p, t: t.vllm_generation.vllm_client.generate(prompts=p, logprobs=5),
     "raised ValueError: trainer.vllm_generation.vllm_client.generate: logprobs=5 is not supported by hpcrl's "
     "engines (they return the sampled token's log-probability only: logprobs=0)"),
    ("unknown-keyword", lambda p, t: t.vllm_generation.vllm_client.generate(prompts=p, best_of=2),
     "raised TypeError: trainer.vllm_generation.vllm_client.generate() got an unexpected keyword argument 'best_of'"),
    ("prompt-ids-not-ids", lambda p, t: t.vllm_generation.vllm_client.generate(prompts=[{"input_ids": [1, 2]}]),
     "raised TypeError: trainer.vllm_generation.vllm_client.generate: prompts[0] is neither a text nor a list of "
     "token ids: dict {'input_ids': [1, 2]}"),
    ("colocated-vllm", lambda p, t: t.vllm_generation.llm.generate(p),
     "raised AttributeError: trainer.vllm_generation.llm: hpcrl's engines run in their own processes"),
]


@pytest.mark.parametrize("func,expect", [c[1:] for c in BAD_OUTPUTS], ids=[c[0] for c in BAD_OUTPUTS])
def test_what_cannot_be_trained_on_is_one_line(func, expect):
    from hpcrl.compute.agents.rollout_func import RolloutFunctionError

    with pytest.raises(RolloutFunctionError) as e:
        _run(func)
    assert "\n" not in str(e.value) and expect in str(e.value), str(e.value)


# ---------------------------------------------------------------------------- the trainer's generation, as TRL's
def test_the_client_answers_as_trls_vllm_client_does():
    """The same completions through TRL's VLLMClient.generate (its HTTP answer made from them) and
    through hpcrl's: the same dict."""
    from trl.generation.vllm_client import VLLMClient

    tok = tool_tokenizer()
    seen = {}

    def record(prompts, trainer):
        seen["ours"] = trainer.vllm_generation.vllm_client.generate(prompts=[p for p in prompts[::2]], n=2,
                                                                     max_tokens=5)
        seen["ids"] = trainer.vllm_generation.generate([tok(p)["input_ids"] for p in prompts], None, 2)
        return _one_per_prompt(prompts, trainer)

    rollouts = _rollouts(record, tok)
    generator = rollouts.engines.generator
    rollouts.submit(_batch(), Sampling(n=2, max_tokens=8, seed=1))[1].result()
    rollouts.close()
    ours = seen["ours"]
    first = generator.submit([tok(p)["input_ids"] for p in ("1+2=", "3+4=")],
                             Sampling(n=2, max_tokens=5, seed=1 * 7_919 + 1)).result()
    choices = [{"prompt_token_ids": tok(p)["input_ids"], "token_ids": list(c.token_ids),
                "logprobs": {"tokens": [f"token_id:{t}" for t in c.token_ids], "token_logprobs": list(c.logprobs),
                             "top_logprobs": [{} for _ in c.token_ids]}}
               for p, c in zip(("1+2=", "1+2=", "3+4=", "3+4="), first)]
    client = object.__new__(VLLMClient)
    client.model, client.base_url = "m", "http://nowhere"
    client._post = lambda url, json: {"choices": choices}
    assert ours == client.generate(prompts=["1+2=", "3+4="], n=2, max_tokens=5)
    # VLLMGeneration.generate: a row per completion, prompts given each num_generations times.
    prompt_ids, completion_ids, logprobs, token_ids = seen["ids"]
    assert prompt_ids == [tok("1+2=")["input_ids"]] * 2 + [tok("3+4=")["input_ids"]] * 2
    assert len(completion_ids) == 4 and [len(r) for r in logprobs] == [len(r) for r in completion_ids]
    assert all(lp == [[x] for x in ids] for lp, ids in zip(token_ids, completion_ids))


def test_the_trainer_shows_the_recipes_grpo_fields():
    seen = {}

    def look(prompts, trainer):
        seen.update(n=trainer.num_generations, n_eval=trainer.num_generations_eval, cap=trainer.max_completion_length,
                    t=trainer.temperature, args_t=trainer.args.temperature, tok=trainer.processing_class,
                    kwargs=trainer.chat_template_kwargs, vllm=(trainer.use_vllm, trainer.vllm_mode))
        trainer.my_cache = "kept"           # TRL passes the same trainer every call
        return _one_per_prompt(prompts, trainer)

    rollouts = _rollouts(look, temperature=0.7, num_generations_eval=3)
    rollouts.submit(_batch(), Sampling(n=2, max_tokens=8, seed=1))[1].result()
    rollouts.close()
    assert seen["n"] == 2 and seen["n_eval"] == 3 and seen["cap"] == 8 and seen["t"] == seen["args_t"] == 0.7
    assert seen["tok"] is rollouts.tokenizer and seen["kwargs"] == {} and seen["vllm"] == (True, "server")
    assert rollouts.trainer.my_cache == "kept"


def test_chat_renders_as_the_chat_template_does():
    tok = tool_tokenizer()
    conversation = [{"role": "user", "content": "2+2="}]

    def chat(prompts, trainer):
        out = trainer.vllm_generation.vllm_client.chat(messages=[conversation] * len(prompts), max_tokens=4)
        return {"prompt_ids": out["prompt_ids"], "completion_ids": out["completion_ids"],
                "logprobs": [[lp[0] for lp in row] for row in out["logprobs"]]}

    rows, _ = _run(chat)
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rows.prompt_ids == [tok(rendered, add_special_tokens=False)["input_ids"]] * 4
    assert re.search(r"assistant\n$", rows.texts[0])


def test_make_rollouts_picks_the_rollout_function(tmp_path):
    from hpcrl.compute.agents.rollout_func import RolloutFunction
    from hpcrl.compute.train.rollouts import make_rollouts
    from hpcrl.job import rundir
    from hpcrl.job.agent_config import AgentConfig
    from hpcrl.job.recipe import Recipe

    (tmp_path / rundir.REWARDS_DIR).mkdir()
    (tmp_path / rundir.REWARDS_DIR / "picked_rollouts.py").write_text("def run(prompts, trainer):\n    return {}\n")
    recipe = Recipe(agent=AgentConfig(rollout_func="picked_rollouts:run"))
    tok = tool_tokenizer()
    rollouts = make_rollouts(recipe, types.SimpleNamespace(), tok, tmp_path, 64)
    try:
        assert isinstance(rollouts, RolloutFunction) and rollouts.func.__name__ == "run"
        assert rollouts.reward_functions() == []
    finally:
        rollouts.close()


def test_make_rollouts_takes_a_rollout_function_beside_tools_as_the_first_turns(tmp_path):
    """agent.rollout_func with agent.tools and an environment: the agent's rollouts, their first turns
    the function's, and its `trainer` showing every tool's schema as GRPOTrainer's trainer.tools does."""
    from support import TOOL_MODULE

    from hpcrl.compute.agents.agent_rollouts import AgentRollouts
    from hpcrl.compute.train.rollouts import make_rollouts
    from hpcrl.job import rundir
    from hpcrl.job.agent_config import AgentConfig
    from hpcrl.job.recipe import Recipe

    modules = tmp_path / rundir.REWARDS_DIR
    modules.mkdir()
    (modules / "picked_rollouts.py").write_text("def run(prompts, trainer):\n    return {}\n")
    (modules / "parity_tools.py").write_text(TOOL_MODULE)
    (modules / "counter_env.py").write_text(textwrap.dedent('''
        class Counter:
            def reset(self, **row):
                self.n = 0

            def bump(self, by: int) -> int:
                """Add to the count.

                Args:
                    by: How much.
                """
                self.n += by
                return self.n
    '''))
    recipe = Recipe(agent=AgentConfig(rollout_func="picked_rollouts:run", tools=("parity_tools:add",),
                                      environment_factory="counter_env:Counter", tool_workers=1))
    rollouts = make_rollouts(recipe, types.SimpleNamespace(), tool_tokenizer(), tmp_path, 64)
    try:
        assert isinstance(rollouts, AgentRollouts) and rollouts.first_turns.func.__name__ == "run"
        trainer = rollouts.first_turns.trainer
        assert [t["function"]["name"] for t in trainer.tools] == ["add", "bump"]
        assert trainer.chat_template is None            # Qwen2.5's template is prefix-preserving
    finally:
        rollouts.close()


# ---------------------------------------------------------------------------- in flight: which weights sampled each token
class SyncAfterTheFirstRequest:
    """The engines in flight, scripted: a sync lands after the call's first request (version 0, then
    1), and, where ``inside``, inside the second request's completions (their last token 2). Each
    completion's tokens say which request made it."""

    def __init__(self, inside=False):
        self.version, self.requests, self.inside = 0, 0, inside

    def submit(self, prompts, sampling: Sampling) -> Generated:
        self.requests += 1
        ids = (40 + self.requests, 50 + self.requests, 60)
        stamps = (self.version, self.version, 2) if self.inside and self.requests == 2 else None
        out = [Completion(k, ids, (-0.5,) * 3, "", True, self.version, token_versions=stamps)
               for k in range(len(prompts)) for _ in range(sampling.n)]
        self.version = 1
        return Generated(out)


def _two_turns(cut=False):
    def rollout(prompts, trainer):
        """A guess, the environment's two tokens, a second guess (cut: its last token dropped)."""
        client, out = trainer.vllm_generation.vllm_client, {k: [] for k in ("prompt_ids", "completion_ids",
                                                                              "logprobs", "env_mask")}
        for p in prompts:
            first, second = (client.generate(prompts=[p], n=1, max_tokens=3) for _ in range(2))
            a, b = first["completion_ids"][0], second["completion_ids"][0][:2 if cut else 3]
            out["prompt_ids"].append(first["prompt_ids"][0])
            out["completion_ids"].append(a + [11, 12] + b)
            out["logprobs"].append([-0.5] * (len(a) + 2 + len(b)))
            out["env_mask"].append([1] * len(a) + [0, 0] + [1] * len(b))
        return out
    return rollout


@pytest.mark.parametrize("cut,inside,stamps", [
    (False, False, (0, 0, 0, 0, 0, 1, 1, 1)),       # the first turn (and the environment's tokens after it) 0
    (False, True, (0, 0, 0, 0, 0, 1, 1, 2)),        # the sync inside the second turn shows too
    (True, False, None),                            # the function changed a turn: the oldest version, 0
], ids=["between-turns", "inside-a-turn", "a-turn-cut-by-the-function"])
def test_in_flight_a_calls_rows_carry_each_tokens_version_where_they_are_the_engines_tokens(cut, inside, stamps):
    from hpcrl.compute.agents.rollout_func import RolloutFunction, RolloutFunctionError

    tok = tool_tokenizer()
    grpo = GRPOConfig(num_generations=1, max_completion_length=8)
    rollouts = RolloutFunction(_two_turns(cut), "my_rollouts.run", SyncAfterTheFirstRequest(inside), tok, grpo,
                               in_flight=True)
    try:
        rows, pending = rollouts.submit(_batch(["1+2="]), Sampling(n=1, max_tokens=8, seed=1))
        (completion,) = pending.result()
    finally:
        rollouts.close()
    assert (completion.weight_version, completion.token_versions) == (0, stamps)
    # Between requests a push waits for the call: versions that differ are the loop's bug, said as such.
    between = RolloutFunction(_two_turns(), "my_rollouts.run", SyncAfterTheFirstRequest(), tok, grpo)
    try:
        with pytest.raises(RolloutFunctionError, match=r"came from weight versions \[0, 1\]"):
            between.submit(_batch(["1+2="]), Sampling(n=1, max_tokens=8, seed=1))[1].result()
    finally:
        between.close()
