"""The agent demo's model ("demo:<size>:agent", hpcrl.compute.models.tiny_agent) and its example
files: the chat template renders tools in one short line, TRL's helpers take it as it is
(tool calling, prefix-preserving, calls parsed by the tokenizer's own response template), the
conversation the warm-up trains on is token for token the one the rollouts build, the built model
directory keeps all of it, and the examples agree with the model (the tool's schema, the tasks).
The warm-up's outcome and the learning itself are tests/e2e/test_agent_demo.py's."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
from conftest import REPO

trl = pytest.importorskip("trl")

from trl.chat_template_utils import (is_chat_template_prefix_preserving, parse_response,  # noqa: E402
                                     supports_tool_calling)

from hpcrl.compute.agents.conversation import ToolChat  # noqa: E402
from hpcrl.compute.models import tiny, tiny_agent  # noqa: E402
from hpcrl.job.demo import demo_renders_tools  # noqa: E402

TOOLS = [tiny_agent.CALCULATOR_TOOL]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "23+48"}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return tiny_agent.build_tokenizer()


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_template_renders_tools_in_one_line_and_plain_chats_as_chatml(tok):
    user = [{"role": "user", "content": "23+48="}]
    text = tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\n<tools>calculator(expression)</tools><|im_end|>\n"
                    "<|im_start|>user\n23+48=<|im_end|>\n<|im_start|>assistant\n")
    # Short enough for a tiny model (Qwen2.5's template spends ~550 tokens before the question).
    assert len(tok.apply_chat_template(user, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)) <= 40
    system = [{"role": "system", "content": "Be brief."}, *user]
    assert tok.apply_chat_template(system, tools=TOOLS, tokenize=False).startswith(
        "<|im_start|>system\nBe brief.\n<tools>calculator(expression)</tools><|im_end|>\n<|im_start|>user\n")
    # Without tools: the demo models' ChatML.
    chat = [*system, {"role": "assistant", "content": "71"}]
    plain = tiny.build_tokenizer()
    assert tok.apply_chat_template(chat, tokenize=False) == plain.apply_chat_template(chat, tokenize=False)
    # Every tool on the line, and its arguments in their order.
    second = {"type": "function", "function": {"name": "power", "parameters": {
        "type": "object", "properties": {"base": {"type": "integer"}, "exponent": {"type": "integer"}}}}}
    assert "<tools>calculator(expression), power(base, exponent)</tools>" in tok.apply_chat_template(
        user, tools=[*TOOLS, second], tokenize=False)


def test_trl_takes_the_template_and_the_tokenizer_parses_calls(tok):
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    chat = ToolChat(tok)        # TRL knows no such template: the tokenizer's response template is used
    assert chat.chat_template is None, "prefix-preserving: no training template in its place"
    prompt = chat.prompt_ids([{"role": "user", "content": "23+48="}], TOOLS)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "23+48"}}}
    assert chat.parse(_ids(tok, CALL + "<|im_end|>"), prompt, TOOLS) == {
        "role": "assistant", "content": "", "tool_calls": [call]}
    two = chat.parse(_ids(tok, "Let me add." + CALL + CALL + "<|im_end|>"), prompt, TOOLS)
    assert two["content"] == "Let me add." and two["tool_calls"] == [call, call]
    assert chat.parse(_ids(tok, "71<|im_end|>"), prompt, TOOLS) == {"role": "assistant", "content": "71"}
    # A malformed call is text, as TRL falls back to it.
    broken = parse_response(tok, _ids(tok, '<tool_call>{"name": </tool_call><|im_end|>'), prefix=prompt, tools=TOOLS)
    assert "tool_calls" not in broken and broken["content"].startswith("<tool_call>")
    # The tags are single tokens, and kept in decoded text (Qwen2.5's are too).
    assert all(len(_ids(tok, tag)) == 1 for tag in tiny_agent.TOOL_TOKENS)
    assert tok.decode(_ids(tok, CALL), skip_special_tokens=True) == CALL


def test_the_rollouts_ids_are_the_templates_rendering_of_the_whole_conversation(tok):
    """What the warm-up trains on (prompt + call + the tool result's ids + answer, as the rollouts
    concatenate them) is the chat template's own rendering of the conversation."""
    chat = ToolChat(tok)
    user = [{"role": "user", "content": "23+48="}]
    result = [{"role": "tool", "name": "calculator", "content": "71"}]
    ids = (chat.prompt_ids(user, TOOLS) + _ids(tok, CALL + "<|im_end|>") + chat.suffix_ids(result)
           + _ids(tok, "71<|im_end|>"))
    conversation = [*user, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "23+48"}}}]},
        *result, {"role": "assistant", "content": "71"}]
    rendered = tok.apply_chat_template(conversation, tools=TOOLS, tokenize=True, return_dict=False)
    assert rendered == ids + _ids(tok, "\n")
    assert tok.decode(chat.suffix_ids(result)) == \
        "\n<|im_start|>user\n<tool_response>71</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_the_built_model_keeps_its_template_and_response_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quick = dataclasses.replace(tiny_agent.AGENT_WARMUP, max_steps=2, check_pairs=8)
    out = tiny.make_tiny_model(tmp_path / "agent", warmup=quick)
    marker = json.loads((out / tiny.MARKER).read_text())
    assert marker["warmup"] == dataclasses.asdict(quick) and marker["warmup_result"]["steps"] == 2
    assert tiny.make_tiny_model(out, warmup=quick) == out            # built: left alone
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == tiny_agent.CHAT_TEMPLATE and tok.response_template == tiny_agent.RESPONSE_TEMPLATE
    assert len(tok) == tiny.VOCAB_SIZE and all(len(_ids(tok, tag)) == 1 for tag in tiny_agent.TOOL_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == tiny.VOCAB_SIZE and model.config.initializer_range == quick.init_std


def test_only_the_agent_demo_model_renders_tools():
    assert demo_renders_tools("demo:tiny:agent") and demo_renders_tools("demo::agent")
    assert not any(map(demo_renders_tools, ["demo:tiny", "demo:", "demo:small:random"]))


def test_the_examples_agree_with_the_model():
    from transformers.utils import get_json_schema

    tools, rewards = _example("calculator_tools"), _example("calculator_rewards")
    # The schema the warm-up rendered its prompts with is the example tool's.
    assert get_json_schema(tools.calculator) == tiny_agent.CALCULATOR_TOOL
    assert tools.calculator("23+48") == "71" and tools.calculator(" 7 / 2") == "3.5"
    assert tools.calculator("-(3*4)+2") == "-10"
    for bad in ("__import__('os')", "2**8", "abs(-1)", "True+1"):
        with pytest.raises(ValueError, match="not arithmetic"):
            tools.calculator(bad)
    # The tasks are calculator_rows' (the sums the warm-up drew from).
    lines = (REPO / "examples" / "calculator_tasks.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == tiny_agent.calculator_rows(len(lines), seed=0)
    answered = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "71"},
                {"role": "assistant", "content": " 71"}]
    assert rewards.correct(completions=[answered, answered[:2], [{"role": "assistant", "content": "71 or so"}]],
                           answer=["71", "71", "71"]) == [1.0, 0.0, 0.0]


def test_content_blocks_render_as_their_text(tok):
    """A message whose content is a list of blocks (a dataset's prompts may be; vLLM's start-up
    check renders one so) reads as its text, tool results included."""
    def conversation(wrap):
        return [{"role": "system", "content": wrap("be brief")}, {"role": "user", "content": wrap("12+13=")},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+13"}}}]},
                {"role": "tool", "name": "calculator", "content": wrap("25")}, {"role": "assistant", "content": wrap("25")}]

    blocks = lambda text: [{"type": "text", "text": text}]      # noqa: E731
    for tools in (None, [tiny_agent.CALCULATOR_TOOL]):
        assert tok.apply_chat_template(conversation(blocks), tools=tools, tokenize=False) == \
            tok.apply_chat_template(conversation(str), tools=tools, tokenize=False)
