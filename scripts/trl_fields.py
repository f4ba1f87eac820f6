"""Writes hpcrl/login/trl_fields.json: every field `trl grpo --config` takes, with TRL's default.

The login side never imports trl (it imports torch), so the names and defaults it checks a TRL
config against are this file's copy; tests/login/test_trl_config.py fails when the installed TRL differs.

    .venv/bin/python scripts/trl_fields.py      # after a TRL upgrade
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "hpcrl" / "login" / "trl_fields.json"


def trl_fields() -> dict:
    import trl
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    fields = {}
    for cls in (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig):
        for f in dataclasses.fields(cls):
            if not f.init or f.name.startswith("_") or f.name in fields:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = None
            if hasattr(default, "value"):           # an Enum: its value, as YAML would spell it
                default = default.value
            if isinstance(default, float) and math.isinf(default):
                default = "inf"
            try:
                json.dumps(default)
            except TypeError:
                default = repr(default)
            fields[f.name] = {"class": cls.__name__, "default": default}
    return {"trl_version": trl.__version__, "fields": fields}


if __name__ == "__main__":
    OUT.write_text(json.dumps(trl_fields(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
