"""`hpcrl run examples/agent.yaml` learns to call its tool: the agent demo's model ("demo:tiny:agent",
warmed up to call the calculator on some of the sums it cannot add by itself) under GRPO with a
reward for the right answer calls the tool more and more often, and the reward rises with it.

One real run end to end as a user starts it, from the repository's root (mpiexec, one FSDP2
trainer and its tool workers, the vLLM server, weights synced after every step), cut to 20 steps:
about a minute and a half on two CPU cores, most of it the model's warm-up (~40 s) and the
engine's start. Sampling is seeded, so on one machine the run is the same every time; the margins
below leave room for other machines' numerics.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from conftest import REPO, WHOLE_RUN, run_to_the_end
from support import window_means

PY = sys.executable
STEPS = 20
START, END = 3, 10         # steps averaged at each end: the calls catch on within ~10 steps

pytestmark = WHOLE_RUN


def check_learning(steps: list[dict]) -> str:
    """Assert that the run learnt to call its tool; returns a line with the numbers."""
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    calls0, calls1 = window_means(steps, "tools/call_frequency", START)[0], window_means(
        steps, "tools/call_frequency", END)[1]
    reward0, reward1 = window_means(steps, "reward", START)[0], window_means(steps, "reward", END)[1]
    failures = window_means(steps, "tools/failure_frequency", END)[1]
    line = (f"tools/call_frequency {calls0:.3f} -> {calls1:.3f}, reward {reward0:.3f} -> {reward1:.3f}, "
            f"tools/failure_frequency {failures:.3f} (means of the first {START} and last {END} of {STEPS} steps)")
    # Measured on a 2-core VM, grpo.seed 0: calls 0.27 -> 0.96, reward 0.22 -> 0.85, failures 0.02;
    # with learning_rate 1e-8 (no learning) calls 0.25 -> 0.28, reward 0.20 -> 0.25. Seeds 0-9 (each
    # its own warm-up): calls 0.27-0.47 -> 0.94-0.96, reward rises 0.38-0.63; every bar below holds
    # on 9 of them, seed 8 ends at reward 0.62 (its warm-up copies less well: p_copy 0.72).
    assert calls0 < 0.6, f"the warmed-up model already calls every time, nothing left to show: {line}"
    assert calls1 - calls0 >= 0.3 and calls1 >= 0.8, f"the model did not learn to call its tool: {line}"
    assert reward1 - reward0 >= 0.25 and reward1 >= 0.7, f"the reward did not rise with the calls: {line}"
    assert failures <= 0.2, f"most calls fail: {line}"
    return line


def check_exported_model(model_dir: Path) -> None:
    """The run's model loads as any Hugging Face model, keeps its chat template and response
    template, and calls the calculator on a sum, greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.compute.models.tiny_agent import CALCULATOR_TOOL, CHAT_TEMPLATE, RESPONSE_TEMPLATE

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert tok.chat_template == CHAT_TEMPLATE and tok.response_template == RESPONSE_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "36+57="}], tools=[CALCULATOR_TOOL],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    turn = tok.parse_response(out[0, len(prompt):].tolist(), prefix=prompt, tools=[CALCULATOR_TOOL])
    assert turn.get("tool_calls") == [{"type": "function", "function": {
        "name": "calculator", "arguments": {"expression": "36+57"}}}], turn


def test_the_agent_demo_learns_to_call_its_tool(tmp_path, hpcrl_home):
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "hpcrl", "run", "--run-dir", str(run_dir), "examples/agent.yaml", f"max_steps={STEPS}"]
    t0 = time.monotonic()
    proc = run_to_the_end(cmd, REPO, 480)
    seconds = time.monotonic() - t0
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, (out + err)[-3000:]
    assert f"hpcrl: finished: step {STEPS} of {STEPS} in " in out, out[-2000:]

    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    line = check_learning(steps)
    warmup = json.loads((run_dir / "model-tiny-agent" / "hpcrl_tiny.json").read_text())["warmup_result"]
    check_exported_model(run_dir / "model")
    print(f"{line}; warm-up {warmup}; {seconds:.0f} s in all")
