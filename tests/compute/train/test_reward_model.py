"""A Hugging Face sequence-classification model as a reward (TRL's reward_model_name_or_path):
sharded over the trainers like the reference model, it scores as the whole model scores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_harness import spawn
from support import make_reward_model
from hpcrl.job.recipe import GRPOConfig, Recipe

PROMPTS = ["1+2=", "3+4=", "5+0=", "2+2="]
COMPLETIONS = ["3", " 7 and more", "5", "x"]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    from hpcrl.compute.models.tiny import make_tiny_model

    tiny = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)
    return make_reward_model(tmp_path_factory.mktemp("models") / "rm", str(tiny))


def whole_model_scores(path: str) -> list[float]:
    """What TRL computes with the unsharded model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer([p + c for p, c in zip(PROMPTS, COMPLETIONS)], return_tensors="pt", padding=True,
                       padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return model(**inputs).logits[:, 0].tolist()


def _w_sharded(rank, world, path, expected):
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train.reward_model import load_reward_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    recipe = Recipe(grpo=GRPOConfig(per_device_train_batch_size=3, bf16=False))      # micro-batches of 3, 1
    scorer = load_reward_model(path, mesh, torch.device("cpu"), recipe)
    assert scorer.__name__ == "rm"
    shard = [p.to_local().numel() for p in scorer.model.parameters()]
    assert sum(shard) < sum(p.numel() for p in scorer.model.parameters())     # no rank holds it whole
    got = scorer(PROMPTS, COMPLETIONS)
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-5), (got, expected)
    conversational = scorer.texts([[{"role": "user", "content": "1+2="}]], [[{"role": "assistant", "content": "3"}]])
    assert "1+2=" in conversational[0] and "3" in conversational[0]


def test_a_sharded_reward_model_scores_as_the_whole_one(reward_model_dir, tmp_path):
    spawn(_w_sharded, tmp_path, reward_model_dir, whole_model_scores(reward_model_dir), timeout=240)


def test_a_reward_model_in_a_recipe_and_a_trl_config(reward_model_dir, tmp_path, monkeypatch):
    from hpcrl.job.errors import UserError
    from hpcrl.login import compose

    monkeypatch.chdir(Path(reward_model_dir).parent)
    (tmp_path / "cfg.yaml").write_text("model_name_or_path: m\ndataset_name: d\nreward_model_name_or_path: rm\n"
                                       "reward_funcs: [think_format_reward]\nreward_weights: [0.5, 1.0]\n")
    r = compose.build_recipe(str(tmp_path / "cfg.yaml")).recipe
    assert [(x.model, x.func, x.weight) for x in r.rewards] == [(reward_model_dir, "", 0.5),
                                                                ("", "think_format_reward", 1.0)]
    with pytest.raises(UserError, match=r"rewards\[0\]: give func .* or model .*not both"):
        compose.build_recipe(None, ["rewards=[{func: a.b, model: rm}]"])
