#!/usr/bin/env python
"""Agent rollouts per second: per-sample scheduling against TRL's lockstep rounds, same run.

Both schedules run hpcrl's own AgentRollouts (hpcrl.compute.agents) on one vLLM(-cpu) engine in
this process, with its tools in real tool workers (agent.tool_workers of them, 4 by default, as a
trainer rank has): `lockstep` is TRL's loop (every rollout of a round waits for the round's slowest
turn, the engine for the round's slowest tool), `per_sample` moves each rollout on as soon as its own
turn or tool is done (hpcrl.compute.agents.per_sample, over the engine's continuous batching, as
the server serves a trainer's stream).

The rollouts call a tool that sleeps --tool-ms (50) and returns "ok", for --turns turns each. The
tiny model has random weights and cannot call tools: the bench's chat (BenchChat) says that each
turn but the last called `wait`, whatever it sampled; everything else is the real path (the
engine's sampling, the tool-result ids appended by concatenation, the tool workers). Every turn is
at most --max-tokens long and ends where the model samples one of --stop-tokens ordinary tokens, so
turn lengths vary as a real model's do (geometrically; --stop-tokens 0: every turn is full length,
where only the tools' waits differ between the schedules). The seeds differ between the schedules
(per request against per rollout and turn), so the tokens generated are alike, not equal: the table
shows them.

Reported per turns and schedule: rollouts/s (median of --repeats, schedules alternated), seconds a
batch, the tool calls made, the model tokens of the last batch. Last line:
    agent_rollouts_per_s_ratio_vs_lockstep=X        per_sample over lockstep at --target-turns (3)
    [agent_ratio_at_<k>_turns=...]                  the same at every other turn count measured

    .venv/bin/python scripts/bench_agent.py            # 8 prompts x 4 rollouts, 1-4 turns, 50 ms tool
    .venv/bin/python scripts/bench_agent.py --smoke    # that it runs (tests/e2e/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchtable import print_table  # noqa: E402

TOOL_MODULE = '''
import time


def wait() -> str:
    """Wait for the world to answer."""
    time.sleep({seconds})
    return "ok"
'''


class EngineInProcess:
    """An engine in this process as the rollouts' generator: batch requests (``submit``, what the
    lockstep loop asks) and streams (``open_stream``, the per-sample loop's). Generation only: its
    weights stay as loaded."""

    def __init__(self, engine):
        self.engine = engine

    def submit(self, prompts, sampling):
        from hpcrl.compute.inference.types import Generated

        return Generated(self.engine.generate(prompts, sampling))

    def open_stream(self):
        return _InProcessStream(self.engine)


class _InProcessStream:
    def __init__(self, engine):
        self.engine, self.unsent, self.keys = engine, [], {}

    @property
    def outstanding(self) -> int:
        return len(self.unsent) + len(self.keys)

    def add(self, key, prompt_ids, sampling):
        self.unsent.append((key, list(prompt_ids), sampling))

    def take(self, timeout=None):
        if self.unsent:
            ids = self.engine.add([(p, s) for _, p, s in self.unsent])
            self.keys.update((i, key) for i, (key, _, _) in zip(ids, self.unsent))
            self.unsent = []
        deadline = time.monotonic() + (600 if timeout is None else timeout)
        while self.keys:
            done = [(self.keys.pop(i), c) for i, completions in self.engine.step() for c in completions]
            if done or time.monotonic() >= deadline:
                return done
        return []

    def close(self):
        assert not self.outstanding


def bench_chat(tokenizer, turns: int):
    """A ToolChat whose model calls `wait` on each of its first ``turns`` - 1 turns, whatever it
    sampled (the random tiny model cannot call tools)."""
    from hpcrl.compute.agents.conversation import ToolChat

    start = tokenizer.convert_tokens_to_ids("<|im_start|>")

    class BenchChat(ToolChat):
        def parse(self, ids, prefix_ids, tools):
            # The turns so far, from the <|im_start|>s their tool results put after the prompt's
            # (the model never samples one: it is not among the allowed tokens).
            done = (list(prefix_ids).count(start) - self.prompt_starts) // self.result_starts
            if done < turns - 1:
                return {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "wait", "arguments": {}}}]}
            return {"role": "assistant", "content": "done"}

    chat = BenchChat(tokenizer)
    chat.prompt_starts = chat.prompt_ids([{"role": "user", "content": "1+2="}], []).count(start)
    chat.result_starts = chat.suffix_ids([{"role": "tool", "name": "wait", "content": "ok"}]).count(start)
    return chat


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--turns", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--target-turns", type=int, default=3)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--tool-workers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64, help="the longest a turn may be")
    ap.add_argument("--stop-tokens", type=int, default=16,
                    help="ordinary tokens that end a turn (16 of the tiny model's 381: ~24 tokens a turn on "
                         "average); 0: every turn is --max-tokens long")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="2 prompts x 2, 1-2 turns, 4 tokens, once")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.generations, args.turns, args.target_turns = 2, 2, [1, 2], 2
        args.max_tokens, args.repeats, args.tool_ms = 4, 1, 10.0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import trl

    from hpcrl.compute.agents.agent_rollouts import AgentRollouts
    from hpcrl.compute.agents.tool_pool import ToolPool
    from hpcrl.compute.inference.types import Sampling
    from hpcrl.compute.inference.vllm_engine import VLLMEngine
    from hpcrl.compute.models.tiny import SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer, make_tiny_model
    from hpcrl.compute.train.data import PromptBatch
    from hpcrl.job.grpo_config import GRPOConfig
    from hpcrl.job.recipe import InferenceConfig

    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-agent-"))
    model_dir = make_tiny_model(work / "model", size="tiny", seed=0)
    tokenizer = build_tokenizer()
    # Qwen2.5's template (TRL's copy): it renders tools, and TRL parses its calls.
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    (work / "bench_tools.py").write_text(TOOL_MODULE.format(seconds=args.tool_ms / 1000))
    t0 = time.perf_counter()
    engine = VLLMEngine(str(model_dir), InferenceConfig(max_model_len=2048), device="cpu", seed=0)
    print(f"vLLM engine ready in {time.perf_counter() - t0:.1f} s; tool {args.tool_ms:g} ms, "
          f"{args.tool_workers} tool workers, {args.prompts} prompts x {args.generations} rollouts, "
          f"turns of at most {args.max_tokens} tokens, ending at {args.stop_tokens} stop tokens", flush=True)
    generator = EngineInProcess(engine)
    # No special token (end of turn, a turn's opening) is sampled; a turn ends at one of
    # --stop-tokens ordinary tokens (a random model samples each about equally: turn lengths are
    # geometric, as varied as a real model's), or at max_tokens.
    allowed = list(range(len(SPECIAL_TOKENS), VOCAB_SIZE))
    kwargs = {"allowed_token_ids": allowed, "stop_token_ids": allowed[:args.stop_tokens]}
    sampling = Sampling(n=args.generations, max_tokens=args.max_tokens, temperature=1.0, seed=1,
                        generation_kwargs=kwargs)
    prompts = [[{"role": "user", "content": f"{i}+{i + 1}="}] for i in range(args.prompts)]
    batch = PromptBatch(prompts, ["" for _ in prompts], [[] for _ in prompts], {}, list(range(len(prompts))))

    pool = ToolPool(["bench_tools:wait"], workers=args.tool_workers, timeout_s=30, module_dir=work)
    rows, ratios = [], {}
    for turns in args.turns:
        grpo = GRPOConfig(num_generations=args.generations, max_completion_length=turns * (args.max_tokens + 200),
                          max_tool_calling_iterations=turns - 1)
        chat = bench_chat(tokenizer, turns)
        times: dict[str, list[float]] = {"lockstep": [], "per_sample": []}
        calls, tokens = {}, {}
        for rep in range(-1 if not rows else 0, args.repeats):      # -1: a warm-up, not timed
            for schedule in (("lockstep", "per_sample") if rep % 2 == 0 else ("per_sample", "lockstep")):
                rollouts = AgentRollouts(generator, pool, chat, grpo, context_len=2048,
                                         per_sample=schedule == "per_sample")
                start = time.perf_counter()
                _, pending = rollouts.submit(batch, replace(sampling, seed=1 + rep))
                completions = pending.result()
                if rep >= 0:
                    times[schedule].append(time.perf_counter() - start)
                rollouts.executor.shutdown()        # not close(): the pool serves every run
                calls[schedule] = sum(c.tool_use.calls for c in completions)
                tokens[schedule] = sum(c.model_tokens for c in completions)
                assert all(c.tool_use.turns == turns for c in completions), "a rollout ended early"
        n = args.prompts * args.generations
        for schedule, ts in times.items():
            rows.append([turns, schedule, f"{n / statistics.median(ts):.1f}", f"{statistics.median(ts):.3f}",
                         calls[schedule], tokens[schedule]])
        ratios[turns] = statistics.median(times["lockstep"]) / statistics.median(times["per_sample"])
    pool.close()
    engine.close()
    shutil.rmtree(work, ignore_errors=True)     # the model and the tool module: each run makes its own
    print_table("Agent rollouts per second (one vLLM-cpu engine in this process)",
                ["turns", "schedule", "rollouts/s", "s a batch", "tool calls", "model tokens (last batch)"], rows)
    line = [f"agent_rollouts_per_s_ratio_vs_lockstep={ratios[args.target_turns]:.2f}"]
    line += [f"agent_ratio_at_{t}_turns={r:.2f}" for t, r in ratios.items() if t != args.target_turns]
    print(" ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
