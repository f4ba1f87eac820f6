"""In-flight weight updates through the real vLLM engine (inference.weight_update = in_flight, issue 31):
`hpcrl run` on the demo with two generations asked for ahead, each completion its own request on
the trainer's stream, syncs landing between engine steps.

For a sync to land inside a completion the engine must still be sampling when the trainer pushes:
the demo's completions end after two tokens, and its tiny model trains faster than it samples. A
vLLM logits processor (written below, handed to the engine with inference.engine_args, as a user's
would be) forces 24 tokens and spends 60 ms on each step: a generation then takes longer than a
training step.
"""

from __future__ import annotations

import json
import sys
import textwrap

from conftest import WHOLE_RUN, run_to_the_end

from hpcrl.job import metric_keys as mk

PY = sys.executable

pytestmark = WHOLE_RUN

LENGTH = 24
SLOW_DECODING = textwrap.dedent(f'''
    """Written by tests/e2e/test_in_flight_updates.py: {LENGTH} tokens a completion, 60 ms an engine step."""
    import time

    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor


    class SlowLongCompletions(MinTokensLogitsProcessor):
        @staticmethod
        def add_request(params, _prompt_ids, output_tok_ids):
            return ({LENGTH}, output_tok_ids, params.all_stop_token_ids, params.structured_outputs is not None)

        def apply(self, logits):
            time.sleep(0.06)
            return super().apply(logits)
''')


def test_syncs_land_inside_completions_and_each_token_keeps_its_version(tmp_path, hpcrl_home):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "slow_decoding.py").write_text(SLOW_DECODING)
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "hpcrl", "run", "--run-dir", str(run_dir), "grpo.max_steps=6",
           f"grpo.max_completion_length={LENGTH}", "inference.max_staleness=2", "inference.weight_update=in_flight",
           'inference.engine_args={"logits_processors": ["slow_decoding:SlowLongCompletions"]}']
    proc = run_to_the_end(cmd, tmp_path, 400, env={"PYTHONPATH": str(plugins)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "step" in s and mk.STALENESS_MAX in s]
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert all(s[mk.COMPLETIONS_MEAN_LENGTH] == LENGTH for s in steps), [s[mk.COMPLETIONS_MEAN_LENGTH] for s in steps]
    # Never more than 2 syncs behind, counted from a completion's first token; and syncs did land
    # inside completions under way (their tokens carry two versions).
    assert max(s[mk.STALENESS_MAX] for s in steps) <= 2
    in_flight = [s[mk.UPDATED_IN_FLIGHT] for s in steps]
    assert max(in_flight) > 0, in_flight
