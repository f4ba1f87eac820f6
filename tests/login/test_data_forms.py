"""Every form of data TRL's load_dataset(dataset_name, dataset_config) takes, as hpcrl loads it on
the compute side (hpcrl.compute.train.data.load_prompts) and checks it on the login side
(hpcrl.login.inputs), with small files made here; hub ids through a Hugging Face cache laid out
under a temporary HF_HOME (nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpcrl.job import hfcache
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import DataConfig, ModelConfig, Recipe
from hpcrl.job.site import Site
from hpcrl.login import data_inputs, inputs

datasets = pytest.importorskip("datasets")
from hpcrl.compute.train.data import load_prompts  # noqa: E402
from hpcrl.compute.train.sources import load_dataset, resolve_model, tokenizer_dir  # noqa: E402

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    """A private, empty Hugging Face cache; datasets' own cache files go there too."""
    home = tmp_path / "hf"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(home / "datasets"))
    return home


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts(ds) -> list:
    return list(ds["prompt"])


# ---------------------------------------------------------------------------- files
def test_single_files_of_every_format(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    (tmp_path / "a.csv").write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in ROWS))
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.jsonl", "a.json", "a.csv", "a.parquet"):
        ds = load_prompts(tmp_path / name)
        assert prompts(ds) == [r["prompt"] for r in ROWS], name
        assert data_inputs.first_row_columns(tmp_path / name) == ["prompt", "answer"], name
    assert load_prompts(jsonl, "train").column_names == ["prompt", "answer"]


def test_a_single_file_has_only_the_train_split(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"^data.split: 'test': data.path is a file or files, whose only split"):
        load_prompts(jsonl, "test")
    with pytest.raises(ValueError, match=r"^data.eval_split: 'test'"):
        load_prompts(jsonl, "test", split_field="data.eval_split")


def test_a_glob_and_a_list_of_files(tmp_path):
    write_jsonl(tmp_path / "d" / "part-1.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "d" / "part-2.jsonl", ROWS[2:])
    assert prompts(load_prompts(str(tmp_path / "d" / "*.jsonl"))) == [r["prompt"] for r in ROWS]
    cfg = DataConfig(data_files=(str(tmp_path / "d" / "part-2.jsonl"), str(tmp_path / "d" / "part-1.jsonl")))
    assert prompts(load_dataset(cfg)) == [r["prompt"] for r in ROWS[2:] + ROWS[:2]]
    with pytest.raises(FileNotFoundError, match="data.path: no file matches"):
        load_prompts(str(tmp_path / "d" / "*.parquet"))
    (tmp_path / "d" / "x.csv").write_text("prompt\na\n")
    with pytest.raises(ValueError, match="data.data_files: the files mix formats"):
        load_dataset(DataConfig(data_files=(str(tmp_path / "d" / "*"),)))


# ---------------------------------------------------------------------------- directories
def test_a_directory_of_data_files_with_splits(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", ROWS[:3])
    write_jsonl(tmp_path / "d" / "test.jsonl", ROWS[3:])
    assert len(load_prompts(tmp_path / "d")) == 3
    assert prompts(load_prompts(tmp_path / "d", "test")) == [ROWS[3]["prompt"]]
    with pytest.raises(ValueError, match=r"data.split: .* has no split 'validation' \(splits: train, test\)"):
        load_prompts(tmp_path / "d", "validation")
    recipe = Recipe(data=DataConfig(path=str(tmp_path / "d"), split="validation"))
    with pytest.raises(UserError, match="data.split: no file in .* is named for split 'validation'"):
        inputs.check_inputs(recipe, Site(name="x"))
    inputs.check_inputs(Recipe(data=DataConfig(path=str(tmp_path / "d"), split="test")), Site(name="x"))


def test_a_dataset_configuration_is_load_dataset_name(tmp_path):
    """TRL's dataset_config (data.config): a configuration the dataset's README declares."""
    d = tmp_path / "cfgs"
    write_jsonl(d / "easy" / "train.jsonl", ROWS[:1])
    write_jsonl(d / "hard" / "train.jsonl", ROWS[1:])
    (d / "README.md").write_text("---\nconfigs:\n- config_name: easy\n  data_files:\n  - split: train\n"
                                 "    path: easy/*.jsonl\n- config_name: hard\n  data_files:\n  - split: train\n"
                                 "    path: hard/*.jsonl\n---\n")
    assert len(load_prompts(d, config="hard")) == 3
    assert len(load_dataset(DataConfig(path=str(d), config="easy"))) == 1
    with pytest.raises(ValueError, match="^data.config: 'medium'"):
        load_prompts(d, config="medium")


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    one = tmp_path / "one"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(one))
    assert len(load_prompts(one)) == 4
    with pytest.raises(ValueError, match="data.split: 'test': .* is a single saved Dataset"):
        load_prompts(one, "test")
    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                          "test": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(str(both))
    assert len(load_prompts(both, "test")) == 1
    with pytest.raises(ValueError, match=r"data.split: .* has no split 'dev' \(splits: train, test\)"):
        load_prompts(both, "dev")
    site = Site(name="x")
    inputs.check_inputs(Recipe(data=DataConfig(path=str(both), split="test")), site)
    with pytest.raises(UserError, match=r"data.split: .* has no split 'dev' \(splits: train, test\)"):
        inputs.check_inputs(Recipe(data=DataConfig(path=str(both), split="dev")), site)
    with pytest.raises(UserError, match="data.prompt_column: no 'question' column in .*columns: prompt, answer"):
        inputs.check_inputs(Recipe(data=DataConfig(path=str(one), prompt_column="question")), site)


# ---------------------------------------------------------------------------- the prompt column, bad rows
def test_prompt_column_is_renamed_or_named_missing(tmp_path):
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    f = write_jsonl(tmp_path / "q.jsonl", rows)
    assert prompts(load_prompts(f, prompt_column="question")) == [r["prompt"] for r in ROWS]
    with pytest.raises(ValueError, match="^data.prompt_column: no 'prompt' column"):
        load_prompts(f)


def test_a_corrupt_row_is_one_line_naming_it(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    inputs.check_inputs(Recipe(data=DataConfig(path=str(f))), Site(name="x"))     # the first row is fine
    with pytest.raises(ValueError, match=r"^data.path: .*bad.jsonl line 2 is not JSON \(") as e:
        load_prompts(f)
    assert "\n" not in str(e.value)
    f.write_text("{not json\n")
    with pytest.raises(UserError, match=r"data.path: .*bad.jsonl: line 1 is not JSON"):
        inputs.check_inputs(Recipe(data=DataConfig(path=str(f))), Site(name="x"))


# ---------------------------------------------------------------------------- hub ids in the cache
def _snapshot(home: Path, kind: str, repo_id: str) -> Path:
    repo = home / "hub" / f"{kind}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snap


def test_a_downloaded_hub_dataset_is_read_from_the_cache(hf_home):
    snap = _snapshot(hf_home, "dataset", "acme/sums")
    write_jsonl(snap / "data" / "train.jsonl", ROWS[:3])
    write_jsonl(snap / "data" / "test.jsonl", ROWS[3:])
    assert len(load_prompts("acme/sums")) == 3
    assert len(load_dataset(DataConfig(path="acme/sums", split="test"))) == 1
    inputs.check_inputs(Recipe(data=DataConfig(path="acme/sums", split="test")), Site(name="x"))
    with pytest.raises(UserError, match="data.prompt_column: no 'question' column"):
        inputs.check_inputs(Recipe(data=DataConfig(path="acme/sums", prompt_column="question")), Site(name="x"))


def test_a_hub_dataset_load_dataset_prepared_before_is_read_offline(hf_home, tmp_path):
    """What an earlier datasets.load_dataset("acme/prepared") left in datasets' cache, made here
    from a local file and put under the name that load would have given it."""
    src = write_jsonl(tmp_path / "src.jsonl", ROWS)
    made = datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(tmp_path / "made"))
    built = Path(made.cache_files[0]["filename"]).parent
    dest = hf_home / "datasets" / "acme___prepared" / "default" / "0.0.0" / built.name
    shutil.copytree(built, dest)
    for arrow in dest.glob("json-*.arrow"):
        arrow.rename(dest / arrow.name.replace("json-", "prepared-"))
    del made
    assert len(load_prompts("acme/prepared")) == 4
    inputs.check_inputs(Recipe(data=DataConfig(path="acme/prepared")), Site(name="x"))


def test_a_hub_id_not_in_the_cache(hf_home):
    with pytest.raises(FileNotFoundError, match=r"data.path: acme/absent is neither a local path nor a dataset in "
                                                r"the Hugging Face cache .*HF_HUB_OFFLINE=1.*huggingface-cli download "
                                                r"--repo-type dataset acme/absent"):
        load_prompts("acme/absent")
    with pytest.raises(UserError, match="data.path: 'acme/absent' is neither .*--repo-type dataset acme/absent"):
        inputs.check_inputs(Recipe(data=DataConfig(path="acme/absent")), Site(name="x"))
    with pytest.raises(UserError, match=r"model.path: 'acme/model' is neither .*\(HF_HUB_OFFLINE=1\).*"
                                        r"`huggingface-cli download acme/model`"):
        inputs.check_inputs(Recipe(model=ModelConfig(path="acme/model")), Site(name="x"))
    with pytest.raises(FileNotFoundError, match="model.path: acme/model is neither .*huggingface-cli download"):
        resolve_model("acme/model", "/nonexistent")


def test_a_cached_hub_model_and_tokenizer(hf_home):
    snap = _snapshot(hf_home, "model", "acme/tiny-lm")
    (snap / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"model.path: acme/tiny-lm \(cached at .*\) has no weights"):
        inputs.check_inputs(Recipe(model=ModelConfig(path="acme/tiny-lm")), Site(name="x"))
    (snap / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="model.path: acme/tiny-lm .* has no tokenizer vocabulary .*set model.tokenizer"):
        inputs.check_inputs(Recipe(model=ModelConfig(path="acme/tiny-lm")), Site(name="x"))
    (snap / "tokenizer.json").write_text("{}")
    inputs.check_inputs(Recipe(model=ModelConfig(path="acme/tiny-lm")), Site(name="x"))
    assert resolve_model("acme/tiny-lm", "/nonexistent") == str(snap)
    assert tokenizer_dir(ModelConfig(path="x", tokenizer="acme/tiny-lm"), "/m") == str(snap)


def test_a_cache_only_compute_nodes_see_is_not_checked(hf_home):
    """Frontier's HF_HOME is node-local NVMe: the login node cannot look, so it does not refuse."""
    site = Site(name="x", env={"HF_HOME": "/mnt/bb/$USER/hf", "HF_HUB_OFFLINE": "1"})
    inputs.check_inputs(Recipe(model=ModelConfig(path="acme/model"), data=DataConfig(path="acme/absent")), site)
    with pytest.raises(UserError, match="model.path: 'acme/model'"):
        inputs.check_inputs(Recipe(model=ModelConfig(path="acme/model")), Site(name="x"))


# ---------------------------------------------------------------------------- model directories
def test_model_directory_checks(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    site = Site(name="x")
    with pytest.raises(UserError, match="model.path: .* has no config.json"):
        inputs.check_inputs(Recipe(model=ModelConfig(path=str(m))), site)
    (m / "config.json").write_text("{}")
    (m / "model.safetensors.index.json").write_text("{}")
    (m / "vocab.json").write_text("{}")
    inputs.check_inputs(Recipe(model=ModelConfig(path=str(m))), site)
    tok = tmp_path / "tok"
    tok.mkdir()
    with pytest.raises(UserError, match="model.tokenizer: .*tok has no tokenizer vocabulary"):
        inputs.check_inputs(Recipe(model=ModelConfig(path=str(m), tokenizer=str(tok))), site)
    with pytest.raises(UserError, match="model.path: ./absent does not exist"):
        inputs.check_inputs(Recipe(model=ModelConfig(path="./absent")), site)


def test_hub_ids_and_paths_are_told_apart():
    assert hfcache.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and hfcache.is_hub_id("gsm8k")
    for path in ("/abs/model", "./m", "~/m", "data/train.jsonl", "a/b/c", "../x"):
        assert not hfcache.is_hub_id(path), path


def test_trl_dataset_config_is_data_config():
    from hpcrl.login import trl_config

    t = trl_config.translate({"model_name_or_path": "m", "dataset_name": "openai/gsm8k", "dataset_config": "main"})
    assert t.problems == [] and t.recipe["data"] == {"path": "openai/gsm8k", "config": "main"}
