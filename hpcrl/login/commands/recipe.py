"""`hpcrl recipe`: the recipe a file and key=value overrides resolve to, every field with its value.

For a TRL configuration it also says where each TRL key went and which keys change nothing here,
with why. Writes nothing and needs no site.
"""

from __future__ import annotations

import json

from hpcrl.job.config import to_dict
from hpcrl.login import compose


def main(args) -> int:
    recipe, overrides = compose.split_recipe_and_overrides(args.recipe, args.overrides)
    resolved = compose.build_recipe(recipe, overrides)
    data = to_dict(resolved.recipe)
    trl = resolved.trl
    if args.json:
        out = {"recipe": data}
        if trl is not None:
            out["from_trl"] = {"moved": trl.moved, "not_used": trl.inert}
        print(json.dumps(out, indent=2))
        return 0
    import yaml

    print(yaml.safe_dump(data, sort_keys=False).rstrip())
    if trl is not None and trl.moved:
        print("\n# TRL's keys, and the recipe fields they set:")
        for key, field in trl.moved.items():
            print(f"#   {key:<34} -> {field}")
    if trl is not None and trl.inert:
        print("\n# TRL's keys that change nothing here:")
        for key, why in trl.inert.items():
            print(f"#   {key:<34} {why}")
    return 0
