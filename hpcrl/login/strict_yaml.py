"""YAML as a recipe's author means it: PyYAML's safe loader, less two YAML 1.1 slips.

- A key given twice in one mapping is an error naming both lines (YAML keeps the last silently:
  a second `grpo:` section dropped the first's max_steps).
- `1:30:00` and `45:00` stay the text they were: YAML 1.1 reads them as base-60 numbers (5400,
  2700), so `time: 1:30:00` was submitted as 3-18:00:00.

Imported only where YAML is parsed: `hpcrl status` never loads PyYAML.
"""

from __future__ import annotations

from typing import Any

import yaml


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader with duplicate keys refused and base-60 numbers kept as text."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    lines: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue                        # `<<: *base` keys may be overridden: that is its point
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = lines.get(key)
        except TypeError:                   # an unhashable key: SafeLoader names it below
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (lines {first} and {key_node.start_mark.line + 1}): "
                            f"YAML would keep only the second", key_node.start_mark)
        lines[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


def _sexagesimal_as_text(base):
    def construct(loader: StrictLoader, node: yaml.ScalarNode):
        text = loader.construct_scalar(node)
        return text if ":" in text else base(loader, node)
    return construct


StrictLoader.add_constructor("tag:yaml.org,2002:map", _mapping)
StrictLoader.add_constructor("tag:yaml.org,2002:int", _sexagesimal_as_text(yaml.SafeLoader.construct_yaml_int))
StrictLoader.add_constructor("tag:yaml.org,2002:float", _sexagesimal_as_text(yaml.SafeLoader.construct_yaml_float))


def load(text: str) -> Any:
    """yaml.safe_load with StrictLoader's rules; yaml.YAMLError (problem and problem_mark) on a slip."""
    return yaml.load(text, Loader=StrictLoader)
