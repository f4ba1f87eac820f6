"""The built-in demo's model names, the one place the "demo:" prefix is spelled.

"demo:<size>" is a tiny model the job builds and warms up on the demo task, "demo:<size>:random" one
with random weights (hpcrl.compute.models.tiny); "demo:" alone is "demo:tiny". Neither exists on
any disk before the job, so nothing reads, stages or resolves such a path as a directory.
"""

from __future__ import annotations

DEMO_MODEL_PREFIX = "demo:"
RANDOM_SUFFIX = ":random"
# Whether the demo models' chat template renders tools (an agent recipe needs one that does).
DEMO_CHAT_TEMPLATE_HAS_TOOLS = False


def is_demo(model_path: str) -> bool:
    """Whether `model_path` names a demo model rather than a directory or a hub id."""
    return model_path.startswith(DEMO_MODEL_PREFIX)


def demo_name(size: str) -> str:
    """The model path of the warmed-up demo model of `size` (tiny, small, medium, base, large)."""
    return DEMO_MODEL_PREFIX + size


def parse_demo_model(path: str) -> tuple[str, bool]:
    """``(size, warmed_up)`` of a "demo:<size>" (warmed up on the demo task) or "demo:<size>:random"
    (random weights) model path; "demo:" alone is "demo:tiny"."""
    spec = path.removeprefix(DEMO_MODEL_PREFIX)
    return spec.removesuffix(RANDOM_SUFFIX) or "tiny", not spec.endswith(RANDOM_SUFFIX)
