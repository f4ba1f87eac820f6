"""Multi-turn agents: the model calls tools, reads their results and goes on (TRL's tools=, environment_factory=);
and custom rollouts, a user's function making the completions (TRL's rollout_func=).

conversation.py      the tokenizer's side: prompts rendered with tools, turns parsed, tool results as token ids (TRL's helpers)
rollout.py           TRL's tool-calling loop over rollouts in progress: rounds of tool calls and continuations
per_sample.py        the same turns rollout by rollout: each moves on when its own turn or tools are done (a stream)
agent_rollouts.py    the trainer's multi-turn rollouts: sessions, environments' observations and rewards, the loop in a thread
tool_pool.py         tools and environments run in worker processes: each call bounded, a hung or dead worker replaced
tool_worker.py       what runs inside one tool worker process (the standard library and the user's modules, never torch)
rollout_func.py      a TRL rollout function as the trainer's rollouts: its rows checked, made completions, extra fields to rewards
trainer_view.py      the `trainer` a rollout function gets: GRPOTrainer's attributes, generation through the node's engines
sync_gate.py         the rollout thread and the trainer's weight pushes take turns (generations asked for ahead,
                     between requests; in flight the engines take the push between two steps)
"""
