"""The agent demo's model ("demo:<size>:agent"): a tiny model whose chat template renders tools,
warmed up on calculator conversations so that GRPO can teach it to call its tool.

The template is ChatML in Qwen2.5's style, made short for a tiny model (Qwen2.5's own renders
~550 tokens of instructions before any question): the tools as one system line,
``<tools>calculator(expression)</tools>`` (each tool's name and its arguments' names); a call as
``<tool_call>{"name": "calculator", "arguments": {"expression": "23+48"}}</tool_call>``; tool
results as a user turn of ``<tool_response>71</tool_response>``. It is prefix-preserving (an
assistant turn renders the same whatever follows it), so TRL's tool loop keeps it, and the
tokenizer carries the response template that transformers' ``parse_response`` reads the calls with
(TRL's GRPOTrainer and hpcrl.compute.agents take it as it is). The four tool tags are single tokens.

The task: sums of two numbers of two digits ("23+48="), which the model does not learn by itself in
the warm-up's time. The warm-up (:class:`AgentWarmUp`) trains on conversations that call the
calculator in 40% of the examples and answer directly in the others, until the model copies the
sum into its call and the tool's result into its answer; from there GRPO with a reward for the
right answer raises how often it calls (``tools/call_frequency``) and the reward. The demo's recipe
is examples/agent.yaml, its tool examples/calculator_tools.py's ``calculator``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

__all__ = ["CHAT_TEMPLATE", "RESPONSE_TEMPLATE", "TOOL_TOKENS", "CALCULATOR_TOOL", "AgentWarmUp", "AGENT_WARMUP",
           "build_tokenizer", "calculator_pairs", "calculator_rows", "agent_warm_up"]

CHAT_TEMPLATE = (
    # A message's text: a string, or the text blocks of a list of content blocks (vLLM renders its
    # start-up check, and a dataset may hold prompts, that way).
    "{%- macro text(content) %}{%- if content is string %}{{- content }}{%- elif content %}"
    "{%- for block in content %}{%- if block.type == 'text' %}{{- block.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- fn.name + '(' + ((fn.parameters or {}).properties or {}) | list | join(', ') + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + text(message.content) }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": ' }}{{- fn.name | tojson }}{{- ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user\\n' }}{%- endif %}"
    "{{- '<tool_response>' }}"
    "{{- text(message.content) }}"
    "{{- '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + text(message.content) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' response template (parse_response, transformers >= 5.13) of the template above: TRL's
# qwen3_template without the reasoning field. Saved in tokenizer_config.json with the tokenizer.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# The calculator tool's JSON schema, as transformers' get_json_schema makes it of
# examples/calculator_tools.py's calculator (the template renders only the name and the arguments'
# names, so a docstring's other words change nothing the model sees).
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression: numbers, + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'The expression, e.g. "23+48".'}},
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}


def _call_text(a: int, b: int) -> str:
    arguments = json.dumps({"expression": f"{a}+{b}"})
    return f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'


def build_tokenizer():
    """The tiny models' tokenizer (hpcrl.compute.models.tiny) with this chat template, the tool tags
    as single tokens, merges learnt from calls too (a call is 22 tokens), and the response template."""
    from hpcrl.compute.models import tiny

    rng = random.Random(0)
    calls = [_call_text(rng.randrange(10, 100), rng.randrange(10, 100)) for _ in range(50)]
    corpus = calls + ["<tools>calculator(expression)</tools>"] * 20
    tokenizer = tiny.build_tokenizer(chat_template=CHAT_TEMPLATE, corpus=corpus, added_tokens=TOOL_TOKENS)
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def calculator_pairs(low: int = 10, high: int = 99) -> list[tuple[int, int]]:
    """Every pair ``(a, b)`` of numbers from ``low`` to ``high``: the calculator task's sums."""
    return [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]


def calculator_rows(n: int, seed: int = 0, low: int = 10, high: int = 99) -> list[dict]:
    """``n`` rows of the calculator task drawn from its pairs: a conversational prompt ("23+48=")
    and the ``answer`` ("71"), as examples/calculator_tasks.jsonl holds them."""
    rng = random.Random(seed)
    pairs = calculator_pairs(low, high)
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a, b in (rng.choice(pairs) for _ in range(n))]


@dataclass(frozen=True)
class AgentWarmUp:
    """Settings of the supervised warm-up on calculator conversations: a call in ``call_rate`` of
    the examples (the tool's result follows, then the answer), a direct answer in the others; loss
    on the assistant's tokens only (a tool's result is not the model's). Stops at the first check
    where the model copies right, the mean probability of the right call and then the right answer
    (given that it calls) over ``check_pairs`` sums reaching ``target``, and calls as often as it
    was shown to, its mean probability of calling within ``call_tolerance`` of ``call_rate``; or
    after ``max_steps``. Seeded and run on ``threads`` CPU threads, as
    hpcrl.compute.models.tiny.WarmUp; part of a built model's marker: changed settings rebuild the
    model."""

    call_rate: float = 0.4
    # The probability of calling swings by +-0.2 from one check to the next at this learning rate:
    # the tolerance keeps the demo's start where GRPO has room to raise it.
    call_tolerance: float = 0.1
    target: float = 0.7
    max_steps: int = 2000
    check_every: int = 10
    check_pairs: int = 64
    batch_size: int = 32
    learning_rate: float = 2e-3
    # The weights' initial standard deviation (Qwen2's is 0.02). Copying from the prompt is learnt
    # after a plateau, which a wider start shortens: tiny reaches the target in 210-240 steps with
    # seeds 0-2 (~40 s on one core), against 200-700 from 0.05 and ~650 from 0.02.
    init_std: float = 0.08
    low: int = 10               # the operands' range, as calculator_pairs'
    high: int = 99
    threads: int = 1

    # hpcrl.compute.models.tiny.WarmUpSettings
    def tokenizer(self):
        return build_tokenizer()

    def run(self, model, tokenizer, seed: int) -> dict:
        return agent_warm_up(model, tokenizer, self, seed)


# The agent demo's model ("demo:<size>:agent").
AGENT_WARMUP = AgentWarmUp()


def _examples(chat, a: int, b: int) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """(ids, labels) of the two conversations of a sum: one that calls the tool, one that answers
    directly; built as the rollouts build them (prompt + sampled turn + the tool result's ids + the
    next turn), with labels on the assistant's tokens only."""
    tokenizer = chat.tokenizer
    prompt = chat.prompt_ids([{"role": "user", "content": f"{a}+{b}="}], [CALCULATOR_TOOL])
    answer = tokenizer(str(a + b) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    call = tokenizer(_call_text(a, b) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    result = chat.suffix_ids([{"role": "tool", "name": "calculator", "content": str(a + b)}])
    ignored = [-100] * len(prompt)
    called = (prompt + call + result + answer, ignored + call + [-100] * len(result) + answer)
    direct = (prompt + answer, ignored + answer)
    return called, direct


def _padded(rows: list[tuple[list[int], list[int]]], pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    return ids, labels, mask


def _label_logprobs(model, rows, pad_id: int):
    """Log-probability of each label (0 elsewhere) and where the labels are, per row."""
    ids, labels, mask = _padded(rows, pad_id)
    logp = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
    targets = labels[:, 1:]
    labelled = targets != -100
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * labelled, labelled


def agent_warm_up(model, tokenizer, settings: AgentWarmUp = AGENT_WARMUP, seed: int = 0) -> dict:
    """Train ``model`` (float32, in place, re-initialised with ``settings.init_std``) as
    ``settings`` say; returns ``{"steps", "p_copy", "p_call", "seconds"}``: the steps taken, the
    mean probability of the right call and answer given a call, and of calling, at the end."""
    import time

    import torch

    from hpcrl.compute.agents.conversation import ToolChat

    chat = ToolChat(tokenizer)
    pad = tokenizer.pad_token_id
    pairs = calculator_pairs(settings.low, settings.high)
    checked = random.Random(seed).sample(pairs, settings.check_pairs)
    cache: dict[tuple[int, int], tuple] = {}

    def examples(pair):
        if pair not in cache:
            cache[pair] = _examples(chat, *pair)
        return cache[pair]

    def check() -> tuple[float, float]:
        with torch.no_grad():
            logp, labelled = _label_logprobs(model, [examples(p)[0] for p in checked], pad)
        first = labelled.int().argmax(1)            # where <tool_call> is predicted
        rows = torch.arange(len(checked))
        p_call = logp[rows, first].exp().mean().item()
        return (logp.sum(1) - logp[rows, first]).exp().mean().item(), p_call

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    t0 = time.perf_counter()
    try:
        model.config.initializer_range = settings.init_std
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                    module.weight.normal_(0.0, settings.init_std)
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
        model.train()
        step, (p_copy, p_call) = 0, check()
        while (p_copy < settings.target or abs(p_call - settings.call_rate) > settings.call_tolerance) \
                and step < settings.max_steps:
            picks = torch.randint(len(pairs), (settings.batch_size,), generator=generator).tolist()
            calls = (torch.rand(settings.batch_size, generator=generator) < settings.call_rate).tolist()
            rows = [examples(pairs[i])[0 if c else 1] for i, c in zip(picks, calls)]
            optimizer.zero_grad(set_to_none=True)
            # Conversations that call are twice as long as the others: padded apart, half the work.
            labels = sum(sum(t != -100 for t in row_labels) for _, row_labels in rows)
            for called in (True, False):
                group = [row for row, c in zip(rows, calls) if c == called]
                if group:
                    logp, _ = _label_logprobs(model, group, pad)
                    (-logp.sum() / labels).backward()
            optimizer.step()
            step += 1
            if step % settings.check_every == 0 or step == settings.max_steps:
                p_copy, p_call = check()
        model.eval()
    finally:
        torch.set_num_threads(threads)
    return {"steps": step, "p_copy": round(p_copy, 4), "p_call": round(p_call, 4),
            "seconds": round(time.perf_counter() - t0, 1)}
