"""The agent demo's reward (examples/agent.yaml): the right sum, as the conversation's last word.

An agent's reward functions get each rollout's conversation as its completion (assistant turns and
tool results, as TRL passes them), and the dataset's other columns by name (here `answer`).
"""

from __future__ import annotations


def correct(completions: list[list[dict]], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the rollout ends with the assistant saying the right number and nothing else; a
    rollout that ends on a tool call (it ran out of turns or length) or says more gets 0.0."""
    return [1.0 if conversation and conversation[-1]["role"] == "assistant"
            and conversation[-1]["content"].strip() == expected else 0.0
            for conversation, expected in zip(completions, answer, strict=True)]
