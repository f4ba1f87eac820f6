"""Slurm's stop signal comes early enough for the step in progress and the checkpoint's write (issue #27,
item 8): site.signal "USR2@auto" takes the checkpoint's bytes per node (12 B a trainable parameter over
the nodes, + the reference's shards with sync_ref_model) at site.shared_fs_write_gb_s, + a step's
allowance, in whole minutes, at most Slurm's 65535 s; a lead the site or recipe gives wins; `hpcrl plan`
says the lead and why, render gives it to --signal and holds the time limit to it. Qwen2.5-14B on
frontier (2 GB/s a node): ~177 GB of state, 88.6 GB a node on 2 nodes."""

from __future__ import annotations

import json
import math

import pytest

from hpcrl.job.lora import LoraTargets
from hpcrl.job.model_shape import model_shape
from hpcrl.job.signal_lead import CHECKPOINT_BYTES_PER_PARAM, STEP_ALLOWANCE_S, signal_lead
from hpcrl.login.cli import main as cli_main
from hpcrl.login.compose import compose

# Qwen/Qwen2.5-14B and Qwen/Qwen2.5-1.5B, config.json (the keys the estimate reads).
QWEN_14B = {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 48, "vocab_size": 152064,
            "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 8,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN_1_5B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "vocab_size": 151936,
             "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
             "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
# A batch the 1.5B model fits on frontier with (render refuses one that does not).
FITS = ["grpo.per_device_train_batch_size=8", "grpo.num_generations=8", "grpo.max_completion_length=1024",
        "inference.max_model_len=2048"]


def _model(tmp_path, cfg: dict) -> str:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def _spec(site, nodes, *overrides):
    return compose(None, site, list(overrides), {"resources.nodes": nodes, "resources.account": "abc123"},
                   for_plan=True)


def _stop_line(capsys) -> str:
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("stop signal:"))


def _minutes(seconds: float) -> int:
    return math.ceil(seconds / 60) * 60


@pytest.mark.parametrize("nodes, lead", [(1, 420), (2, 360)])
def test_14b_on_frontier_waits_for_its_checkpoint_and_a_step(tmp_path, nodes, lead):
    model = _model(tmp_path, QWEN_14B)
    params = model_shape(model)[0].params
    spec = _spec("frontier", nodes, f"model.path={model}")
    got = signal_lead(spec, spec.plan())
    assert got.derived and got.bytes_per_node == math.ceil(params * CHECKPOINT_BYTES_PER_PARAM / nodes)
    assert got.lead_s == _minutes(got.bytes_per_node / 2e9 + STEP_ALLOWANCE_S) == lead
    assert spec.signal_lead_s == lead           # what render gives --signal


def test_a_slower_file_system_and_a_moving_reference_lengthen_it_and_lora_shortens_it(tmp_path):
    model = _model(tmp_path, QWEN_14B)
    params = model_shape(model)[0].params
    slow = ["site.shared_fs_write_gb_s=0.5"]
    state = math.ceil(params * 12 / 2)                          # 88.6 GB a node
    assert _spec("frontier", 2, f"model.path={model}", *slow).signal_lead_s == _minutes(state / 0.5e9 + 300) == 480
    # sync_ref_model: each trainer saves its shards of the bf16 reference, sharded over the 14 trainers of
    # the 2 nodes 14B needs: a whole bf16 copy a node (29.5 GB more)
    spec = _spec("frontier", 2, f"model.path={model}", *slow, "grpo.beta=0.04", "grpo.sync_ref_model=true")
    got = signal_lead(spec, spec.plan())
    assert got.bytes_per_node == state + math.ceil(params * 2 / 14) * 7
    assert got.lead_s == _minutes(got.bytes_per_node / 0.5e9 + 300) == 540
    # LoRA saves the adapters only
    spec = _spec("frontier", 2, f"model.path={model}", *slow, "model.use_peft=true", "model.lora_r=16")
    adapters = LoraTargets.of(model_shape(model)[0], spec.recipe.model.lora_target_modules, 16, 0.05).params
    got = signal_lead(spec, spec.plan())
    assert got.bytes_per_node == math.ceil(adapters * 12 / 2) and got.lead_s == 360


def test_a_lead_the_site_or_recipe_gives_wins(tmp_path, capsys):
    model = _model(tmp_path, QWEN_14B)
    assert _spec("frontier", 2, f"model.path={model}", "site.signal=USR2@900").signal_lead_s == 900
    assert _spec("testbed", 1).signal_lead_s == 60                 # the testbed's own USR2@60
    assert _spec("testbed", 1, "site.signal=USR2@auto").signal_lead_s == 360
    # plan says when the site's lead is shorter than the write it must hold
    assert cli_main(["plan", "--site", "frontier", "-N", "2", f"model.path={model}", "site.signal=USR2@30"]) == 0
    assert _stop_line(capsys) == ("stop signal: USR2 30 s before the time limit (site.signal USR2@30); a checkpoint of ~88.6 GB a "
                    "node takes ~45 s at 2 GB/s (site.shared_fs_write_gb_s), longer than the lead: a checkpoint at "
                    "the signal would not be done before the limit (site.signal=USR2@auto derives a lead)")


def test_plan_says_the_lead_and_why(tmp_path, capsys):
    model = _model(tmp_path, QWEN_14B)
    assert cli_main(["plan", "--site", "frontier", "-N", "2", f"model.path={model}"]) == 0
    assert _stop_line(capsys) == (
        "stop signal: USR2 360 s before the time limit (site.signal USR2@auto): a checkpoint of ~88.6 GB a node "
        "takes ~45 s at 2 GB/s (site.shared_fs_write_gb_s), + 300 s for the step in progress (hpcrl has no "
        "estimate of a step; if yours take longer, set site.signal=USR2@<seconds>), rounded up to whole minutes")
    assert cli_main(["plan", "--site", "frontier", "-N", "2", f"model.path={model}", "--json"]) == 0
    stop = json.loads(capsys.readouterr().out)["stop_signal"]
    assert stop["signal"] == "USR2@auto" and stop["lead_s"] == 360 and stop["derived"]
    assert (stop["write_s"], stop["shared_fs_write_gb_s"], stop["step_allowance_s"]) == (44.3, 2.0, 300)
    # A model hpcrl cannot size: the allowance alone, and why
    assert cli_main(["plan", "--site", "cuda", "model.path=/nowhere/here"]) == 0
    assert _stop_line(capsys).startswith(
        "stop signal: USR2 300 s before the time limit (site.signal USR2@auto): the checkpoint's size is unknown "
        "(no config.json in /nowhere/here on this machine), so 300 s for the step in progress")


def test_the_lead_stops_at_slurms_limit(tmp_path):
    model = _model(tmp_path, QWEN_14B)
    spec = _spec("frontier", 2, f"model.path={model}", "resources.time=24:00:00", "resources.partition=extended",
                 "site.shared_fs_write_gb_s=0.001")
    got = signal_lead(spec, spec.plan())
    assert got.lead_s == spec.signal_lead_s == 65535 and got.capped
    assert got.describe("USR2@auto").endswith(", at most Slurm's 65535 s")


def test_render_gives_the_derived_lead_and_holds_the_time_limit_to_it(hpcrl, tmp_path):
    """1.5B on 2 frontier nodes at 0.05 GB/s: 9.3 GB a node in 186 s, + 300 s: 540 s. With start-up's
    300 s, a limit of 14 minutes leaves no step."""
    model = _model(tmp_path, QWEN_1_5B)
    args = ["render", "--site", "frontier", "-A", "abc123", "-N", "2", f"model.path={model}", *FITS,
            "site.shared_fs_write_gb_s=0.05"]
    r = hpcrl(*args, "-t", "00:14:00", "--run-dir", tmp_path / "short")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert ("time: 00:14:00 leaves no time to train on frontier: start-up and a first step take about 300 s (site "
            "startup_s) and Slurm's USR2 warning comes 540 s before the limit (site.signal USR2@auto); ask for more "
            "than 840 s") in r.stderr
    r = hpcrl(*args, "-t", "00:15:00", "--run-dir", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    script = (tmp_path / "run" / "job.sbatch").read_text()
    assert "#SBATCH --signal=B:USR2@540\n" in script and "Slurm sends SIGUSR2 540 s before the time limit" in script
    assert json.loads((tmp_path / "run" / "job.json").read_text())["signal_lead_s"] == 540


@pytest.mark.parametrize("override, said", [
    ("site.signal=USR2@70000", "site.signal: a lead of 70000 s is over Slurm's limit of 65535 s"),
    ("site.signal=USR2@soon", "site.signal: 'USR2@soon' is not a signal and its lead in seconds"),
    ("site.shared_fs_write_gb_s=0", "site.shared_fs_write_gb_s: must be > 0 (GB/s a node writes), got 0.0"),
])
def test_signal_settings_are_checked(hpcrl, tmp_path, override, said):
    r = hpcrl("render", "--site", "testbed", override, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
