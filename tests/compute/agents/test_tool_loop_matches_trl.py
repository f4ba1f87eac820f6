"""Multi-turn rollouts with tools against TRL 1.16's own GRPOTrainer, on the same scripted model.

A real (tiny) GRPOTrainer with ``tools=`` runs its ``_generate_and_score_completions`` (its tool
loop, parsing, masks, rewards, metrics) with only ``_generate_single_turn`` stubbed by a scripted
"model" that calls tools; hpcrl's AgentRollouts run the same script through the Generator
interface, with the tools in real worker processes (hpcrl.compute.agents.tool_pool). The script
covers a tool call answered and continued, a direct answer, an unknown tool, a tool that raises and
is called again next round, a tool result too long for max_completion_length (rolled back), and a
continuation cut at the completion budget. The conversations the reward functions see, the token
ids, tool_mask, sampling log-probabilities, rewards, advantages, tools/ metrics and the loss must
equal TRL's: on Qwen2.5's chat template in both of hpcrl's schedules (TRL's lockstep rounds, and
rollout by rollout over a stream), and per sample on three templates whose tool turns read
differently (Qwen3's, not prefix-preserving: TRL's training template; Llama 3.1's JSON calls and
`ipython` results; GPT-OSS's harmony channels), each with its own special tokens and end of turn.
With a rollout function beside the tools (TRL's rollout_func= with tools=: its rows are the first
turns, the tool loop goes on from them), on TRL's trainer and on hpcrl's `trainer` view: the rows'
prompt ids are the function's, rendered with `trainer.tools` and `trainer.chat_template`.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from support import ScriptedStreamingGenerator, ScriptedToolGenerator, TOOL_MODULE, script_turn, scripted_ids, tool_tokenizer  # noqa: E402

from hpcrl.compute.inference.types import Sampling  # noqa: E402

G = 4                   # rollouts per prompt
# (chat template, schedule): lockstep rounds are the same code on every template.
CASES = [("qwen2_5", "lockstep"), ("qwen2_5", "per_sample"), ("qwen3", "per_sample"), ("llama3_1", "per_sample"),
         ("gptoss", "per_sample"), ("qwen2_5", "function+lockstep"), ("qwen3", "function+per_sample")]
PROMPTS = ["3+4=", "5+2="]
# The completion budget: room for three turns of the raising tool's rollout, not for the repeated
# text's result (rolled back) nor the long answer (cut). Qwen3 spends ~20 tokens a turn on its
# empty <think> block.
BUDGET = {"qwen3": 290}


def budget(template: str) -> int:
    return BUDGET.get(template, 230)

ITERATIONS = 3
TEMPERATURE = 1.0

SEEN: dict[str, list] = {"trl": [], "hpcrl": []}
TRL_RUNS: dict[tuple, tuple] = {}       # (template, with a rollout function) -> TRL's run (shared by its schedules)


def rollout_func(prompts, trainer):
    """A TRL rollout function: each group's prompt rendered with the trainer's tools and template, its
    completions from trainer.vllm_generation.vllm_client, and a field for the reward functions."""
    tok, g = trainer.processing_class, trainer.num_generations
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "origin": "function"}
    for k in range(0, len(prompts), g):
        text = tok.apply_chat_template(prompts[k], tools=trainer.tools, chat_template=trainer.chat_template,
                                       add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        got = trainer.vllm_generation.vllm_client.generate(prompts=[ids], n=g, max_tokens=trainer.max_completion_length)
        for completion, logprobs in zip(got["completion_ids"], got["logprobs"]):
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append([lp[0] for lp in logprobs])
    return out


class ScriptClient:
    """TRL's VLLMClient.generate on the script, for TRL's trainer (the stand-in's answer in the client's shape)."""

    def __init__(self, tok, template):
        self.tok, self.template = tok, template

    def generate(self, prompts, n, max_tokens, **sampling):
        out = [scripted_ids(self.tok, script_turn(self.tok.decode(p), j, self.template), max_tokens)
               for p in prompts for j in range(n)]
        return {"prompt_ids": prompts, "completion_ids": [ids for ids, _, _ in out],
                "logprobs": [[[lp] for lp in lps] for _, lps, _ in out]}


def answer_reward(completions, answer, **kwargs):
    SEEN["current"].append(completions)
    return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent_tools")
    (d / "parity_tools.py").write_text(TOOL_MODULE)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


@pytest.fixture(scope="module", params=CASES, ids=[f"{t}-{s}" for t, s in CASES])
def case(request):
    return request.param


@pytest.fixture(scope="module")
def trl_run(case, tools_dir, tmp_path_factory):
    key = (case[0], case[1].startswith("function"))
    if key not in TRL_RUNS:
        TRL_RUNS[key] = _trl_run(*key, tmp_path_factory)
    SEEN["trl"] = TRL_RUNS[key][3]
    return TRL_RUNS[key][:3]


def _trl_run(template, function, tmp_path_factory):
    import datasets
    import parity_tools
    from trl import GRPOConfig, GRPOTrainer

    tok = tool_tokenizer(template)
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("grpo")), use_cpu=True, bf16=False, report_to=[],
                      per_device_train_batch_size=G * len(PROMPTS), num_generations=G,
                      max_completion_length=budget(template), temperature=TEMPERATURE, save_strategy="no",
                      max_tool_calling_iterations=ITERATIONS)
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": str(eval(p[:-1]))} for p in PROMPTS]
    ds = datasets.Dataset.from_list(rows)
    tr = GRPOTrainer(model=model, reward_funcs=[answer_reward], args=args, train_dataset=ds, processing_class=tok,
                     tools=[parity_tools.add, parity_tools.boom, parity_tools.repeat],
                     rollout_func=rollout_func if function else None)
    tr.current_gradient_accumulation_steps = 1      # set by the training loop, which we do not run
    tr.vllm_generation = types.SimpleNamespace(vllm_client=ScriptClient(tok, template))

    def generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = [scripted_ids(tok, script_turn(tok.decode(p), i % G, template), budget(template))
               for i, p in enumerate(prompt_ids)]
        return [ids for ids, _, _ in out], [lps for _, lps, _ in out]

    tr._generate_single_turn = generate_single_turn
    SEEN["current"] = seen = []
    inputs = [row for row in rows for _ in range(G)]
    out = tr._generate_and_score_completions(inputs)
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items() if v}
    return tr, out, metrics, seen


@pytest.fixture(scope="module")
def hpcrl_run(case, tools_dir, tmp_path_factory):
    """hpcrl's rollouts of the script, in TRL's lockstep rounds and rollout by rollout (a stream that
    answers out of order): the same conversations either way."""
    import torch.distributed as dist

    from hpcrl.compute.agents.agent_rollouts import AgentRollouts
    from hpcrl.compute.agents.conversation import ToolChat
    from hpcrl.compute.agents.rollout_func import RolloutFunction
    from hpcrl.compute.agents.tool_pool import ToolPool
    from hpcrl.compute.train.data import PromptBatch
    from hpcrl.compute.train.rewards import RewardFunction, reward_inputs, score_completions
    from hpcrl.compute.train.scoring import tool_stats
    from hpcrl.job.grpo_config import GRPOConfig

    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("dist") / "store"
        dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    template, schedule = case
    tok = tool_tokenizer(template)
    grpo = GRPOConfig(num_generations=G, max_completion_length=budget(template),
                      max_tool_calling_iterations=ITERATIONS)
    pool = ToolPool([f"parity_tools:{name}" for name in ("add", "boom", "repeat")], workers=2, timeout_s=30,
                    module_dir=tools_dir)
    generator = ScriptedToolGenerator(tok) if schedule.endswith("lockstep") else ScriptedStreamingGenerator(tok, G)
    chat = ToolChat(tok)
    function = schedule.startswith("function")
    first_turns = (RolloutFunction(rollout_func, "parity:rollout_func", generator, tok, grpo, tools=pool.schemas(),
                                   chat_template=chat.chat_template) if function else None)
    rollouts = AgentRollouts(generator, pool, chat, grpo, context_len=4096, first_turns=first_turns)
    try:
        prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
        batch = PromptBatch(prompts, ["" for _ in prompts], [[] for _ in prompts],
                            {"answer": [str(eval(p[:-1])) for p in PROMPTS]}, [0, 1])
        rows, pending = rollouts.submit(batch, Sampling(n=G, max_tokens=budget(template), temperature=TEMPERATURE,
                                                           seed=7))
        completions = pending.result()
        SEEN["current"] = SEEN["hpcrl"] = []
        shown, extra = reward_inputs(rows.prompts, completions)
        rewards = score_completions([RewardFunction("answer_reward", answer_reward)], rows.prompts, shown,
                                    [list(c.token_ids) for c in completions], rows.columns, **extra)
        stats = tool_stats(completions, None)
        if schedule.endswith("per_sample"):       # a seed per rollout and turn, none reused
            seeds = [seed for _, seed in generator.seeds]
            first_turns_elsewhere = len(completions) if function else 0     # the function's, not on the stream
            assert len(set(seeds)) == len(seeds) == sum(c.tool_use.turns for c in completions) - first_turns_elsewhere
        if function:
            assert set(rows.columns["origin"]) == {"function"}
    finally:
        rollouts.close()
    return tok, rows, completions, rewards, stats


def _trl_rows(out, key: str, lengths) -> list[list]:
    return [out[key][i, :n].tolist() for i, n in enumerate(lengths)]


def test_conversations_ids_and_masks_match_trl(trl_run, hpcrl_run):
    tr, out, _ = trl_run
    tok, rows, completions, _, _ = hpcrl_run
    assert SEEN["hpcrl"][-1] == SEEN["trl"][-1]         # what the reward functions were handed
    assert [p for p in rows.prompt_ids] == [p[m.bool()].tolist() for p, m in zip(out["prompt_ids"], out["prompt_mask"])]
    lengths = [len(c.token_ids) for c in completions]
    assert _trl_rows(out, "completion_mask", lengths) == [[1] * n for n in lengths]   # no longer, no shorter
    assert [list(c.token_ids) for c in completions] == _trl_rows(out, "completion_ids", lengths)
    assert [list(c.tool_mask) for c in completions] == _trl_rows(out, "tool_mask", lengths)
    # The script covers every branch of the loop (else this test would prove less than it says).
    turns = [c.tool_use.turns for c in completions]
    assert max(turns) == 3 and 1 in turns                          # a second round; a direct answer
    assert any(c.tool_use.failures for c in completions)           # unknown tool, a raise
    rolled_back = [c for c in completions if c.tool_use.calls and c.tool_use.turns == 1]
    assert rolled_back and rolled_back[0].messages[-1].get("tool_calls")    # ended on its own call
    assert any(0 in c.tool_mask and c.truncated for c in completions)      # cut at the budget after a tool


def test_sampling_logprobs_rewards_and_metrics_match_trl(trl_run, hpcrl_run):
    from hpcrl.compute.train.advantages import compute_advantages
    from hpcrl.job import metric_keys as mk

    tr, out, metrics = trl_run
    tok, rows, completions, rewards, stats = hpcrl_run
    # TRL keeps the engine's log-probabilities only with vLLM; the stub's are what the loop built.
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.tool_mask) if m == 0)
    advantages, _ = compute_advantages(rewards, G, [1.0], tr.scale_rewards, "sum_then_normalize")
    torch.testing.assert_close(advantages, out["advantages"], atol=1e-6, rtol=0)
    assert 0 < advantages.abs().max()
    for key in (mk.TOOLS_CALL_FREQUENCY, mk.TOOLS_FAILURE_FREQUENCY):
        assert math.isclose(stats[key], metrics[key], abs_tol=1e-6), (key, stats[key], metrics[key])
    assert stats[mk.TOOLS_TURNS_MEAN] > 1
    # TRL's completion lengths count the model's tokens only.
    assert math.isclose(sum(c.model_tokens for c in completions) / len(completions),
                        metrics["completions/mean_length"], abs_tol=1e-6)


def test_loss_with_tool_mask_matches_trl(trl_run, hpcrl_run):
    from hpcrl.compute.train import logprobs
    from hpcrl.compute.train.batch import pack_batch
    from hpcrl.compute.train.loss import LossConfig, grpo_loss

    tr, out, _ = trl_run
    tok, rows, completions, _, _ = hpcrl_run
    torch.manual_seed(0)
    trl_loss = tr._compute_loss(tr.model, out)
    batch = pack_batch(rows.prompt_ids, completions, tok.pad_token_id, "cpu")
    assert batch["loss_mask"].sum() < batch["completion_mask"].sum()      # tool tokens take no loss
    logits = tr.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"]).logits
    logps = logprobs.completion_logprobs(logits, batch["completion_ids"], TEMPERATURE)
    config = LossConfig(loss_type=tr.loss_type, beta=tr.beta, epsilon_low=tr.epsilon_low,
                        epsilon_high=tr.epsilon_high, max_completion_length=tr.args.max_completion_length,
                        gradient_accumulation_steps=1, steps_per_generation=tr.args.steps_per_generation)
    loss, _ = grpo_loss(logps, None, None, out["advantages"], batch["loss_mask"], config,
                        num_items_in_batch=batch["loss_mask"].sum())
    torch.testing.assert_close(loss, trl_loss, atol=1e-6, rtol=0)


def test_a_rollout_functions_env_mask_stays_beside_tools(tools_dir):
    """Beside tools, a rollout function's env_mask is its first turn's mask (TRL would train on those
    tokens): tokens the environment put before the model's tool call stay out of the loss, and the
    tool loop goes on from the call."""
    from hpcrl.compute.agents.agent_rollouts import AgentRollouts
    from hpcrl.compute.agents.conversation import ToolChat
    from hpcrl.compute.agents.rollout_func import RolloutFunction
    from hpcrl.compute.agents.tool_pool import ToolPool
    from hpcrl.compute.train.data import PromptBatch
    from hpcrl.job.grpo_config import GRPOConfig

    tok = tool_tokenizer()
    said = tok("Hint: add them.\n", add_special_tokens=False)["input_ids"]

    def hinted(prompts, trainer):
        out = rollout_func(prompts, trainer)
        out["completion_ids"] = [said + ids for ids in out["completion_ids"]]
        out["logprobs"] = [[0.0] * len(said) + lps for lps in out["logprobs"]]
        out["env_mask"] = [[0] * len(said) + [1] * (len(ids) - len(said)) for ids in out["completion_ids"]]
        return out

    grpo = GRPOConfig(num_generations=G, max_completion_length=230, max_tool_calling_iterations=ITERATIONS)
    pool = ToolPool(["parity_tools:add"], workers=1, timeout_s=30, module_dir=tools_dir)
    generator = ScriptedStreamingGenerator(tok, G)
    chat = ToolChat(tok)
    rollouts = AgentRollouts(generator, pool, chat, grpo, context_len=4096, first_turns=RolloutFunction(
        hinted, "hinted", generator, tok, grpo, tools=pool.schemas(), chat_template=chat.chat_template))
    try:
        batch = PromptBatch([[{"role": "user", "content": "3+4="}]], [""], [[]], {}, [0])
        rows, pending = rollouts.submit(batch, Sampling(n=G, max_tokens=230, seed=7))
        first = pending.result()[0]             # variant 0 of the script: it calls add(3, 4)
    finally:
        rollouts.close()
    assert first.tool_use.calls == 1 and first.tool_use.turns == 2, first.tool_use
    assert list(first.token_ids[:len(said)]) == said and list(first.tool_mask[:len(said)]) == [0] * len(said)
    mask = first.tool_mask[len(said):]
    assert mask[0] == 1 and 0 in mask and mask[-1] == 1            # the call, the tool's result, the answer
    assert first.messages[-1]["content"] == "The answer is 7", first.messages
    assert rows.prompt_ids[0] and "add" in rows.texts[0]          # the function's prompt, rendered with the tools
