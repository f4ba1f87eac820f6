"""The corpus of users' TRL projects (scripts/trl_corpus.py), in CI: every project's YAML is valid for
TRL's own parser and `hpcrl plan`/`render --site frontier` take it with an estimate; three projects,
chosen to cover the most, run end to end (`hpcrl run cfg.yaml max_steps=2`) and export a model that
loads, keeps the chat template and differs from the base. The whole corpus: `scripts/trl_corpus.py
check DIR`."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import trl_corpus  # noqa: E402

SMOKE = [p for p in trl_corpus.PROJECTS if p.smoke]
# projects without an `inference:` section run on vLLM where it is installed
SMOKE_PARAMS = [pytest.param(p, id=p.name, marks=[] if "inference" in p.keys else [pytest.mark.vllm])
                for p in SMOKE]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("torch")
    return tmp_path_factory.mktemp("corpus")


def test_the_corpus_spans_what_users_bring():
    archs = {p.arch for p in trl_corpus.PROJECTS}
    assert archs == set(trl_corpus.ARCHS)
    forms = {p.data for p in trl_corpus.PROJECTS}
    assert forms >= {"jsonl", "json", "csv", "parquet", "save_to_disk", "directory", "mixture"}
    keys = [trl_corpus.recipe(p) for p in trl_corpus.PROJECTS]
    assert {k.get("loss_type") for k in keys} >= {"grpo", "dapo", "dr_grpo", "bnpo"}
    assert {k.get("scale_rewards", "group") for k in keys} >= {True, False, "batch"}
    assert sum(bool(k.get("bf16")) for k in keys) == 1          # the CPU emulates bf16 slowly
    assert {p.max_positions for p in trl_corpus.PROJECTS} >= {512, 32768}
    assert len(SMOKE) <= 3


@pytest.mark.parametrize("project", trl_corpus.PROJECTS, ids=lambda p: p.name)
def test_trl_parses_and_hpcrl_plans_and_renders(project, corpus):
    pytest.importorskip("trl")
    result = trl_corpus.check_project(corpus, project, ("trl", "plan", "render"))
    failed = {k: why for k, (why, _) in result.items() if not trl_corpus.passed(why)}
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.parametrize("project", SMOKE_PARAMS)
def test_the_project_runs_as_it_is_and_exports_a_trained_model(project, corpus):
    if "inference" not in project.keys and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    result = trl_corpus.check_project(corpus, project, ("run", "export"))
    failed = {k: why for k, (why, _) in result.items() if not trl_corpus.passed(why)}
    run_out = corpus / project.name / "run.out"
    assert not failed, (failed, run_out.read_text()[-3000:] if run_out.is_file() else "")
