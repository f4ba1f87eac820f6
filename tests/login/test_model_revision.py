"""model.revision (TRL's model_revision): a hub id's branch, tag or commit, found in the Hugging Face
cache as huggingface_hub lays it out, on the login node (hpcrl.login.inputs, site.stage.model_dest's
copy) and on the compute side (hpcrl.compute.train.sources). Which snapshot a revision means is held
to huggingface_hub's own offline resolution (snapshot_download with local_files_only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.job import hfcache
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import ModelConfig, Recipe
from hpcrl.job.site import Site
from hpcrl.login import inputs

REPO = "acme/tiny-lm"
MAIN_SHA, TAG_SHA, LOOSE_SHA = "a" * 40, "b" * 40, "c" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache with three commits of REPO: main's, tag v1's, and one no ref names."""
    home = tmp_path / "hf"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    for sha in (MAIN_SHA, TAG_SHA, LOOSE_SHA):
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({"commit": sha}))
        (snap / "model.safetensors").write_bytes(b"")
        (snap / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN_SHA)
    (repo / "refs" / "v1").write_text(TAG_SHA)
    return home


@pytest.mark.parametrize("revision, sha", [("main", MAIN_SHA), ("v1", TAG_SHA), (LOOSE_SHA, LOOSE_SHA)])
def test_a_revision_names_the_snapshot_huggingface_hub_would_load(hub, revision, sha):
    from huggingface_hub import snapshot_download

    found = hfcache.cached_snapshot(REPO, "model", hub / "hub", revision)
    assert found == hub / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / sha
    assert Path(snapshot_download(REPO, revision=revision, local_files_only=True, cache_dir=hub / "hub")) == found


def test_the_login_node_and_the_job_load_the_revision_asked_for(hub):
    from hpcrl.compute.train.sources import resolve_model

    inputs.check_inputs(Recipe(model=ModelConfig(path=REPO, revision="v1")), Site(name="x"))
    assert json.loads(Path(resolve_model(REPO, "/nonexistent", revision="v1"), "config.json").read_text()) == \
        {"commit": TAG_SHA}
    assert resolve_model(REPO, "/nonexistent").endswith(MAIN_SHA)


def test_a_revision_not_in_the_cache_is_named_with_its_download(hub):
    from hpcrl.compute.train.sources import resolve_model

    with pytest.raises(UserError, match=r"^model.path: 'acme/tiny-lm' at revision 'v2' \(model.revision\) is neither "
                                        r".*`huggingface-cli download --revision v2 acme/tiny-lm`"):
        inputs.check_inputs(Recipe(model=ModelConfig(path=REPO, revision="v2")), Site(name="x"))
    with pytest.raises(FileNotFoundError, match=r"^model.path: acme/tiny-lm at revision v2 \(model.revision\) is "
                                                r"neither .*--revision v2 acme/tiny-lm"):
        resolve_model(REPO, "/nonexistent", revision="v2")
    # A short hash is not looked for: huggingface_hub's offline loading finds full ones only.
    assert hfcache.cached_snapshot(REPO, "model", hub / "hub", LOOSE_SHA[:7]) is None


@pytest.mark.parametrize("bad", ["../../etc", "", "-rf", "a b"])
def test_what_cannot_be_a_revision_is_refused(bad):
    with pytest.raises(UserError, match=r"^model.revision: .* is not a hub revision: a branch, a tag or a commit"):
        ModelConfig(revision=bad).validate("model")


def test_a_trl_users_model_revision_is_staged_and_noted_where_unused(hub, hpcrl, tmp_path):
    """TRL's key, submitted: the copy for the nodes (site.stage.model_dest) is the revision's; a local
    directory has none, and the note says so (transformers ignores it there, so TRL's run does)."""
    cfg = tmp_path / "cfg.yaml"
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg.write_text(f"model_name_or_path: {REPO}\nmodel_revision: v1\ndataset_name: {tmp_path / 'train.jsonl'}\n"
                   "per_device_train_batch_size: 8\nnum_generations: 8\n")
    env = {"HF_HOME": str(hub)}
    r = hpcrl("render", "--site", "frontier", "-A", "abc123", str(cfg), env=env)
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())
    spec = json.loads((run_dir / "job.json").read_text())
    assert spec["recipe"]["model"]["revision"] == "v1" and spec["model_source"].endswith(f"/snapshots/{TAG_SHA}")
    local = hub / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN_SHA
    r = hpcrl("render", "--site", "frontier", "-A", "abc123", str(cfg), f"model.path={local}", env=env)
    assert r.returncode == 0, r.stderr
    assert (f"hpcrl: warning: model.revision 'v1' is not used: model.path {local} is a directory, not a hub id "
            f"(revisions are a hub cache's)") in r.stderr
    r = hpcrl("render", "--site", "frontier", "-A", "abc123", str(cfg), "model.revision=v9", env=env)
    assert r.returncode == 2 and "model.revision" in r.stderr and "--revision v9" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
