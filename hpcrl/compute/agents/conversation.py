"""The tokenizer's side of a tool-calling conversation, as TRL's GRPOTrainer (1.16) handles it.

TRL's own helpers do the work (``trl.chat_template_utils``): the response template that parses a
tool call out of sampled tokens (``add_response_schema``, ``parse_response``), the check that the
chat template renders tool calls at all, and the training template that replaces one that is not
prefix-preserving (the conversation's token ids are built by concatenation, so a template that
re-renders earlier turns differently would make the trained tokens differ from the sampled ones).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["ToolChat"]


class ToolChat:
    """Prompts rendered with their tools, assistant turns parsed, tool results as token ids.

    ``tokenizer`` gets a response template when it has none (as TRL's GRPOTrainer sets one);
    ``chat_template_kwargs``: grpo.chat_template_kwargs, passed to every rendering."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        from trl.chat_template_utils import (add_response_schema, get_training_chat_template,
                                             is_chat_template_prefix_preserving, supports_tool_calling)

        if not supports_tool_calling(tokenizer):
            raise ValueError("the model's chat template cannot render a tool-calling conversation "
                             "(user -> assistant with tool_calls -> tool): agents need a template that does")
        if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
            add_response_schema(tokenizer)      # raises for a template TRL does not know, naming what to do
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        # None: the tokenizer's own template, which is prefix-preserving already.
        self.chat_template = (None if is_chat_template_prefix_preserving(tokenizer)
                              else get_training_chat_template(tokenizer))

    def prompt_ids(self, messages: list[dict], tools: Sequence[dict]) -> list[int]:
        """A conversational prompt's ids with the tools' schemas, as TRL's _tokenize_prompts."""
        out = self.tokenizer.apply_chat_template(
            conversation=[messages], tools=list(tools) or None,   # `or None`: Llama renders tool text for []
            chat_template=self.chat_template, add_generation_prompt=True, tokenize=True, return_dict=True,
            **self.kwargs)
        return list(out["input_ids"][0])

    def render(self, messages: list[dict], tools: Sequence[dict]) -> str:
        """The same prompt as text (the completions log's and the reward functions' rendered prompt)."""
        return self.tokenizer.apply_chat_template(messages, tools=list(tools) or None, chat_template=self.chat_template,
                                                  add_generation_prompt=True, tokenize=False, **self.kwargs)

    def parse(self, ids: Sequence[int], prefix: Sequence[int], tools: Sequence[dict]) -> dict:
        """An assistant turn as a message (with ``tool_calls`` when it calls tools); malformed calls
        fall back to plain text, as TRL's."""
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, list(ids), prefix=list(prefix), tools=list(tools))

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The ids that follow an assistant turn which called tools: the tools' results and the next
        assistant header (TRL's _get_tool_suffix_ids, on a minimal conversation)."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = self._ids(dummy, add_generation_prompt=False)
        full = self._ids(dummy + tool_messages, add_generation_prompt=True)
        # Templates that close a turn with "<eos>\n" (Qwen) slice at the end-of-turn token itself.
        eos = [i for i, t in enumerate(prefix) if t == self.tokenizer.eos_token_id]
        if eos:
            prefix = prefix[:eos[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template renders an assistant turn differently when tool results follow it: "
                             "its tool-result tokens cannot be appended to the sampled ones")
        return full[len(prefix):]

    def _ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        ids: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, chat_template=self.chat_template,
                                                      return_dict=False, **self.kwargs)
        return list(ids)
