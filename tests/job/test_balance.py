"""hpcrl.job.balance: the advice on the split of a node's GPUs between generation and training."""

from __future__ import annotations

import pytest

from hpcrl.job.balance import advise


def test_generation_bound_run_is_told_to_generate_on_more_gpus():
    # 8 GPUs, 1 engine: generation 60 s of a 70 s step, training 10 s on 7 GPUs.
    b = advise(gpus_per_node=8, server_gpus=1, step_s=70, gen_wait_s=60, engine_busy_s=60, train_s=10,
               overlapped=False)
    # work: generation 60 GPU-s, training 70 GPU-s: a/s + b/(8-s) is least at s=4 (15 + 17.5 = 32.5 s).
    assert b.best_server_gpus == 4 and b.gain == pytest.approx(70 / 32.5)
    assert b.advice() == ("generation waits 86% of each step, the engines idle 14%: try inference.gpus=4 "
                          "(a model of this run's timings expects each step 2.2x shorter); "
                          "inference.max_staleness=1 would have the engines sample the next generation while the "
                          "trainers train, one weight sync behind (the same model: each step 1.2x shorter; "
                          "README: Asynchronous generation)")


def test_overlapped_run_balances_the_longer_phase():
    # Overlapped: the step is the longer phase. Training 40 s on 4 GPUs, generation 10 s on 4.
    b = advise(gpus_per_node=8, server_gpus=4, step_s=40, gen_wait_s=0, engine_busy_s=10, train_s=40,
               overlapped=True)
    # work 40 and 160: max(40/s, 160/(8-s)) is least at s=2 (max(20, 26.7)) vs s=1 (max(40, 22.9)).
    assert b.best_server_gpus == 2 and b.gain == pytest.approx(40 / (160 / 6))
    assert "try inference.gpus=2" in b.advice() and "the engines idle 75%" in b.advice()


def test_a_balanced_run_is_told_so():
    b = advise(gpus_per_node=8, server_gpus=4, step_s=20, gen_wait_s=10, engine_busy_s=10, train_s=10,
               overlapped=False)
    assert b.best_server_gpus == 4
    # Balanced, and synchronous: generation beside training would halve the step (max(10, 10) of 20 s).
    assert "the split of GPUs is balanced (inference.gpus=4); inference.max_staleness=1" in b.advice()
    assert b.async_gain == pytest.approx(2.0) and "each step 2.0x shorter" in b.advice()
    already = advise(gpus_per_node=8, server_gpus=4, step_s=10, gen_wait_s=0, engine_busy_s=10, train_s=10,
                     overlapped=True)
    assert already.advice().endswith("the split of GPUs is balanced (inference.gpus=4)")


def test_small_gains_are_not_advice():
    # The best split is one GPU over, for a gain under 10 %: no suggestion.
    b = advise(gpus_per_node=8, server_gpus=3, step_s=20, gen_wait_s=11, engine_busy_s=11, train_s=9,
               overlapped=False)
    assert b.gain < 1.10 and "balanced" in b.advice()


def test_a_node_with_one_possible_split_is_not_called_balanced():
    # 1 trainer + 1 engine (hpcrl run on one machine, a 2-GPU node): trainers wait 92 %, and no
    # other split exists, which the advice says instead of "balanced".
    b = advise(gpus_per_node=2, server_gpus=1, step_s=10, gen_wait_s=9.2, engine_busy_s=9.1, train_s=0.8,
               overlapped=False)
    assert b.advice() == ("generation waits 92% of each step, the engines idle 9%: no other split of a node's 2 "
                          "GPUs exists (inference.gpus=1, the rest training); more nodes add both")


@pytest.mark.parametrize(("gpus", "server", "step"), [(1, 1, 10.0), (8, 0, 10.0), (8, 8, 10.0), (8, 1, 0.0)])
def test_nothing_to_judge(gpus, server, step):
    assert advise(gpus_per_node=gpus, server_gpus=server, step_s=step, gen_wait_s=1, engine_busy_s=1, train_s=1,
                  overlapped=False) is None


def test_from_a_run_directory(tmp_path):
    import json

    from hpcrl.job.balance import from_run

    (tmp_path / ".servers").mkdir()
    for node, busy in ((0, 54.0), (1, 36.0)):          # of 60 s serving: 90 % and 60 % busy
        (tmp_path / ".servers" / f"node-{node}.json").write_text(json.dumps(
            {"node": node, "time": 1060.0, "serving_since": 1000.0, "busy_s": busy}))
    steps = [{"step": i, "time_step_s": 10.0, "time_generation_s": 8.0, "time_train_s": 2.0,
              "time_generation_s_by_node": [8.0, 5.0]} for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
    balance, lines = from_run(tmp_path, gpus_per_node=4, server_gpus=1, overlapped=False)
    assert lines == ["node 0: trainers waited 80% of each step for generation, the engine idled 10%",
                     "node 1: trainers waited 50% of each step for generation, the engine idled 40%"]
    # engines busy 75 % of a 10 s step (7.5 GPU-s on 1 GPU), training 2 s on 3 GPUs (6 GPU-s):
    # 7.5/s + 6/(4-s) is least at s=2 (3.75 + 3 = 6.75) against 9.5 now.
    assert balance.best_server_gpus == 2 and "try inference.gpus=2" in balance.advice()
    assert from_run(tmp_path / "nothing", gpus_per_node=4, server_gpus=1, overlapped=False) == (None, [])


def test_read_metrics_tail_skips_the_cut_line(tmp_path):
    import json

    from hpcrl.job.rundir import read_metrics

    lines = [json.dumps({"step": i, "pad": "x" * 50}) + "\n" for i in range(100)]
    torn = '{"step": 100, "pa'                                                 # a torn last line
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + torn)
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(100))
    tail = read_metrics(tmp_path, max_bytes=len(torn) + len(lines[0]) * 3 + 10)      # starts inside step 96's line
    assert [m["step"] for m in tail] == [97, 98, 99]
    assert read_metrics(tmp_path / "none", max_bytes=100) == []
