"""The built-in demo's model names, the one place the "demo:" prefix is spelled.

"demo:<size>" is a tiny model the job builds and warms up on the demo task, "demo:<size>:random" one
with random weights, "demo:<size>:agent" the agent demo's, whose chat template renders tools, warmed
up on calculator conversations that call a tool (hpcrl.compute.models.tiny, .tiny_agent); "demo:"
alone is "demo:tiny". None exists on any disk before the job, so nothing reads, stages or resolves
such a path as a directory.
"""

from __future__ import annotations

DEMO_MODEL_PREFIX = "demo:"
# What a demo model's weights are, by the name's last part: warmed up on the demo task's sums (no
# suffix), random, or warmed up on calculator conversations (the agent demo's model).
SUMS, RANDOM, AGENT = "", "random", "agent"


def is_demo(model_path: str) -> bool:
    """Whether `model_path` names a demo model rather than a directory or a hub id."""
    return model_path.startswith(DEMO_MODEL_PREFIX)


def demo_name(size: str, variant: str = SUMS) -> str:
    """The model path of the demo model of `size` (tiny, small, medium, base, large) and `variant`."""
    return DEMO_MODEL_PREFIX + size + (":" + variant if variant else "")


def parse_demo_model(path: str) -> tuple[str, str]:
    """``(size, variant)`` of a "demo:<size>[:random|:agent]" model path (variant "" for the
    model warmed up on the demo task); "demo:" alone is "demo:tiny". Another variant is returned as
    it is, for the job to refuse (hpcrl.compute.train.sources)."""
    size, _, variant = path.removeprefix(DEMO_MODEL_PREFIX).partition(":")
    return size or "tiny", variant


def demo_renders_tools(path: str) -> bool:
    """Whether the demo model at `path` has a chat template that renders tools (an agent recipe
    needs one that does): only the agent demo's."""
    return parse_demo_model(path)[1] == AGENT
