"""TRL's dataset mixtures (`datasets:` of a `trl grpo --config` YAML, DatasetMixtureConfig): the
recipe's data.datasets, loaded as TRL's get_dataset loads them (compared with TRL's own where it is
installed), checked on the login side, refused in one line where wrong, and trained on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")

from hpcrl.job.config import build
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import DATASET_BUILDERS, DataConfig, Recipe
from hpcrl.login import compose, trl_config

# Source 0: a jsonl read by the json builder (split train); source 1: a directory of parquet files,
# its "test" split. Each has a column the other lacks; `columns` keeps the prompt and the answer.
A_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "note": "a"} for i in range(5)]
B_TRAIN = [{"prompt": f"{i}+2=", "answer": str(i + 2), "level": 1} for i in range(4)]
B_TEST = [{"prompt": f"{i}+3=", "answer": str(i + 3), "level": 2} for i in range(3)]
B_COLUMNS = "prompt, answer, level"
MIXTURE = [{"path": "json", "data_files": "data/a.jsonl", "columns": ["prompt", "answer"]},
           {"path": "data/b", "split": "test", "columns": ["prompt", "answer"]}]
REWARDS = ("def correct(prompts, completions, answer, **kwargs):\n"
           "    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]\n")


def make_user_files(root: Path, extra: str = "") -> Path:
    """The data, a reward module and a TRL YAML naming the mixture, under `root`; the YAML's path."""
    (root / "data" / "b").mkdir(parents=True)
    (root / "data" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in A_ROWS))
    pq = pytest.importorskip("pyarrow.parquet")
    for name, rows in (("train", B_TRAIN), ("test", B_TEST)):
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / "b" / f"{name}.parquet")
    (root / "mix_rewards.py").write_text(REWARDS)
    (root / "cfg.yaml").write_text(f"""\
model_name_or_path: demo:tiny
datasets: {json.dumps(MIXTURE)}
reward_funcs: [mix_rewards.correct]
{extra}""")
    return root / "cfg.yaml"


EXPECTED = [r["prompt"] for r in A_ROWS] + [r["prompt"] for r in B_TEST]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The user's files in a fresh directory that is also the current one (relative paths start
    there); datasets' cache kept inside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    try:
        import datasets
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    except ImportError:
        pass
    return tmp_path


# ---------------------------------------------------------------------------- translation
def test_trl_datasets_become_data_datasets(user_dir):
    cfg = make_user_files(user_dir, "test_split_size: 0.25\nstreaming: false\n")
    t = trl_config.translate(compose.read_recipe(str(cfg)))
    assert t.problems == []
    assert t.recipe["data"] == {"datasets": MIXTURE, "test_split_size": 0.25}
    assert t.moved["datasets"] == "data.datasets" and t.inert["streaming"] == "TRL's default"
    data = compose.build_recipe(str(cfg)).recipe.data
    first, second = data.datasets
    # Relative paths from the directory hpcrl runs in, where load_dataset takes them from.
    assert first.path == "json" and first.data_files == str(user_dir / "data" / "a.jsonl")
    assert second.path == str(user_dir / "data" / "b") and second.split == "test"
    assert first.columns == second.columns == ("prompt", "answer") and data.test_split_size == 0.25
    assert data.path == "demo" and data.split == "train"


def test_with_dataset_name_too_the_mixture_wins_as_in_trl(user_dir):
    """TRL's CLI loads `datasets` and ignores dataset_name (and its config) with a warning; hpcrl
    lists them as keys that change nothing."""
    t = trl_config.translate({"model_name_or_path": "m", "dataset_name": "x.jsonl", "dataset_config": "c",
                              "datasets": MIXTURE})
    assert t.problems == [] and "path" not in t.recipe["data"] and "config" not in t.recipe["data"]
    assert "ignores it" in t.inert["dataset_name"] and "ignores it" in t.inert["dataset_config"]
    # Without datasets, test_split_size and streaming change nothing in TRL either.
    t = trl_config.translate({"model_name_or_path": "m", "dataset_name": "x", "test_split_size": 0.1})
    assert t.problems == [] and t.inert["test_split_size"] == "TRL uses it only with datasets"
    # streaming: true is named.
    t = trl_config.translate({"model_name_or_path": "m", "datasets": MIXTURE, "streaming": True})
    assert t.problems == ["streaming: streamed datasets are not supported: the prompts are read at start"]


def test_builders_are_datasets_packaged_modules():
    packaged = pytest.importorskip("datasets.packaged_modules")
    assert set(DATASET_BUILDERS) == set(packaged._PACKAGED_DATASETS_MODULES)


@pytest.mark.parametrize("data,expect", [
    ({"datasets": [{"path": "json", "colums": ["prompt"]}]},
     'data.datasets[0].colums: unknown field (did you mean "columns"?)'),
    ({"datasets": [{"data_files": "a.jsonl"}]}, "data.datasets[0].path: required field is missing"),
    ({"datasets": ["a.jsonl"]}, "data.datasets[0]: expected a mapping"),
    ({"datasets": [{"path": "json", "columns": "prompt"}]}, "data.datasets[0].columns: expected a list"),
    ({"datasets": [{"path": "json", "columns": []}]}, "data.datasets[0].columns: a list of column names"),
    ({"datasets": [{"path": "json", "columns": ["prompt", "prompt"]}]},
     "data.datasets[0].columns: 'prompt' is named twice"),
    ({"datasets": [{"path": "json", "fraction": 0.5}, {"path": "csv"}]},
     "data.datasets[1].fraction: unset while another dataset sets one"),
    ({"datasets": [{"path": "json", "fraction": -1}]}, "data.datasets[0].fraction: the dataset's share"),
    ({"datasets": [{"path": "json"}], "test_split_size": 1.5}, "data.test_split_size: a share of the rows"),
    ({"datasets": [{"path": "json"}], "test_split_size": 0}, "data.test_split_size: a share of the rows"),
    ({"test_split_size": 0.1}, "data.test_split_size: splits a mixture only"),
    ({"datasets": [{"path": "json"}], "path": "x.jsonl"}, "data.path: give data.path or data.datasets, not both"),
    ({"datasets": [{"path": "json"}], "split": "test"}, "data.split: 'test': a mixture's splits are train "
                                                         "(test_split_size adds \"test\")"),
])
def test_bad_mixture_fields(data, expect):
    with pytest.raises(UserError) as e:
        build(Recipe, {"data": data})
    assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------- loading
def test_the_mixture_loads_in_trls_order_with_trls_rows(user_dir):
    datasets = pytest.importorskip("datasets")
    from hpcrl.compute.train.sources import load_dataset

    cfg = make_user_files(user_dir)
    data = compose.build_recipe(str(cfg)).recipe.data
    ds = load_dataset(data, seed=0)
    assert list(ds["prompt"]) == EXPECTED and ds.column_names == ["prompt", "answer"]
    assert list(ds["answer"]) == [r["answer"] for r in A_ROWS + B_TEST]
    trl_utils = pytest.importorskip("trl.scripts.utils")
    # TRL's own get_dataset on the YAML's entries, from the same directory: the same rows.
    theirs = trl_utils.get_dataset(trl_utils.DatasetMixtureConfig(datasets=[dict(m) for m in MIXTURE]))
    assert list(theirs) == ["train"] and theirs["train"].to_list() == ds.to_list()
    assert isinstance(theirs["train"], datasets.Dataset)


def test_fractions_and_test_split_as_trl(user_dir):
    """Fractions keep TRL's row counts; test_split_size splits the mixture, seeded: the same split
    on every rank (TRL's is unseeded, so only its sizes and rows are compared)."""
    pytest.importorskip("datasets")
    from hpcrl.compute.train.data import load_mixture
    from hpcrl.compute.train.sources import load_dataset

    make_user_files(user_dir)
    mixture = [{**m, "fraction": f} for m, f in zip(MIXTURE, (0.5, 0.5))]
    recipe = compose.build_recipe(None, flags={"data": {"datasets": mixture, "test_split_size": 2}}).recipe
    assert mixture[0]["data_files"] == "data/a.jsonl"       # the caller's mapping, not made absolute in place
    mixed = load_mixture(recipe.data.datasets)["train"]
    # 5 and 3 rows at equal shares: 3 of each, the first ones.
    assert list(mixed["prompt"]) == EXPECTED[:3] + EXPECTED[5:]
    train = load_dataset(recipe.data, seed=7)
    test = load_dataset(recipe.data, seed=7, split="test", split_field="data.eval_split")
    assert len(test) == 2 and sorted([*train["prompt"], *test["prompt"]]) == sorted(mixed["prompt"])
    assert list(load_dataset(recipe.data, seed=7)["prompt"]) == list(train["prompt"])
    trl_utils = pytest.importorskip("trl.scripts.utils")
    assert trl_utils.get_dataset(trl_utils.DatasetMixtureConfig(datasets=mixture))["train"].to_list() == \
        mixed.to_list()
    theirs = trl_utils.get_dataset(trl_utils.DatasetMixtureConfig(datasets=mixture, test_split_size=2))
    assert sorted(theirs) == ["test", "train"] and len(theirs["test"]) == 2
    assert sorted([*theirs["train"]["prompt"], *theirs["test"]["prompt"]]) == sorted(mixed["prompt"])


def test_a_source_without_the_prompt_column_is_named(user_dir):
    pytest.importorskip("datasets")
    from hpcrl.compute.train.sources import load_dataset

    make_user_files(user_dir)
    (user_dir / "data" / "q.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    cfg = DataConfig(datasets=build(Recipe, {"data": {"datasets": [
        {"path": "json", "data_files": str(user_dir / "data" / "a.jsonl")},
        {"path": "json", "data_files": str(user_dir / "data" / "q.jsonl")}]}}).data.datasets)
    with pytest.raises(ValueError, match=r"^data.prompt_column: no 'prompt' column in data.datasets\[1\]"):
        load_dataset(cfg)


def test_a_cached_hub_dataset_in_a_mixture(user_dir, monkeypatch):
    """A hub id is read from its downloaded snapshot in the Hugging Face cache (compute nodes run
    offline), its split picked as load_dataset picks it; the login check looks at the same files."""
    pytest.importorskip("datasets")
    from hpcrl.compute.train.sources import load_dataset
    from hpcrl.job.site import Site
    from hpcrl.login import inputs
    from test_data_forms import _snapshot

    monkeypatch.setenv("HF_HOME", str(user_dir / "hf"))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    make_user_files(user_dir)
    snap = _snapshot(user_dir / "hf", "dataset", "acme/sums")
    (snap / "data").mkdir()
    (snap / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in B_TRAIN))
    (snap / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in B_TEST))
    mixture = [MIXTURE[0], {"path": "acme/sums", "split": "test", "columns": ["prompt", "answer"]}]
    recipe = compose.build_recipe(None, flags={"data": {"datasets": mixture}}).recipe
    inputs.check_inputs(recipe, Site(name="x"))
    assert list(load_dataset(recipe.data)["prompt"]) == EXPECTED
    bad = compose.build_recipe(None, flags={"data": {"datasets": [{**mixture[1], "columns": ["prompt", "level2"]}]}})
    with pytest.raises(UserError, match=r"^data.datasets\[0\].columns: no 'level2' column in .*test.jsonl"):
        inputs.check_inputs(bad.recipe, Site(name="x"))


def test_a_corrupt_row_of_a_source_is_one_line_naming_it(user_dir):
    pytest.importorskip("datasets")
    from hpcrl.compute.train.data import load_mixture

    make_user_files(user_dir)
    with open(user_dir / "data" / "a.jsonl", "a") as f:
        f.write("{not json\n")
    recipe = compose.build_recipe(None, flags={"data": {"datasets": MIXTURE}}).recipe
    with pytest.raises(ValueError, match=r"^data.datasets\[0\]: .*a.jsonl line 6 is not JSON"):
        load_mixture(recipe.data.datasets)


# ---------------------------------------------------------------------------- login checks and the CLI
def test_the_login_check_passes_a_good_mixture(user_dir):
    from hpcrl.job.site import Site
    from hpcrl.login import inputs

    cfg = make_user_files(user_dir, "test_split_size: 2\neval_strategy: steps\n")
    inputs.check_inputs(compose.build_recipe(str(cfg)).recipe, Site(name="x"))


# (id, extra YAML lines or replaced mixture, text the one line must hold)
BAD = [
    ("missing-file", [{"path": "json", "data_files": "data/nope.jsonl"}],
     "data.datasets[0].data_files: {d}/data/nope.jsonl does not exist"),
    ("no-glob-match", [{"path": "csv", "data_files": ["data/*.parquet"]}],
     "data.datasets[0].data_files: no file matches {d}/data/*.parquet"),
    ("file-as-path", [{"path": "data/a.jsonl"}],
     "data.datasets[0].path: data/a.jsonl is a file; datasets.load_dataset (so TRL) reads files through a builder: "
     "path: json, data_files: data/a.jsonl"),
    ("column-missing", [{"path": "json", "data_files": "data/a.jsonl", "columns": ["prompt", "anser"]}],
     "data.datasets[0].columns: no 'anser' column in {d}/data/a.jsonl (first row's columns: prompt, answer, note) "
     "(did you mean \"answer\"?)"),
    ("prompt-not-kept", [MIXTURE[0], {**MIXTURE[1], "columns": ["answer"]}],
     "data.datasets[1].columns: keeps no 'prompt' column (data.prompt_column); add it"),
    ("split-not-in-dir", [{"path": "data/b", "split": "validation"}],
     "data.datasets[0].split: no file in {d}/data/b is named for split 'validation'"),
    ("split-of-files", [{"path": "json", "data_files": "data/a.jsonl", "split": "test"}],
     "data.datasets[0].split: 'test': data_files as a file or a list of files has one split"),
    ("builder-needs-files", [{"path": "parquet"}],
     "data.datasets[0]: the 'parquet' builder reads the files of data_files or data_dir"),
    ("path-missing", [{"path": "data/nowhere/x"}], "data.datasets[0].path: data/nowhere/x does not exist"),
    ("hub-not-cached", [{"path": "someorg/somedata"}],
     "data.datasets[0].path: 'someorg/somedata' is neither a local path nor a dataset in the Hugging Face cache"),
    ("eval-without-test-split", "eval_strategy: steps\n",
     "data.eval_split: 'test': a mixture's splits are \"train\" and, with data.test_split_size"),
    ("typo", [{"path": "json", "data_file": "data/a.jsonl"}],
     'data.datasets[0].data_file: unknown field (did you mean "data_files"?)'),
    ("streaming", "streaming: true\n", "streaming: streamed datasets are not supported"),
]


@pytest.mark.parametrize("case_id,change,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_mixtures_are_one_line_at_render(user_dir, hpcrl_home, case_id, change, expect):
    from conftest import run_hpcrl

    cfg = make_user_files(user_dir, change if isinstance(change, str) else "")
    if not isinstance(change, str):
        cfg.write_text(cfg.read_text().replace(json.dumps(MIXTURE), json.dumps(change)))
    r = run_hpcrl("render", "--site", "local", "--run-dir", "run", cfg.name, cwd=user_dir,
                  env={"HF_HOME": str(user_dir / "hf")})
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcrl: error: "), r.stderr
    assert expect.format(d=user_dir) in lines[0], lines[0]
    assert "Traceback" not in r.stderr and not (user_dir / "run").exists()


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_hpcrl_run_trains_on_the_mixture(user_dir):
    """The TRL YAML, run as it is for a few steps: every prompt a trainer saw is one of the
    mixture's, and the reward read the answer column the mixture kept."""
    pytest.importorskip("torch")
    from conftest import run_to_the_end

    cfg = make_user_files(user_dir, "max_steps: 3\nper_device_train_batch_size: 8\nnum_generations: 4\n"
                                    "max_completion_length: 4\nlog_completions: true\n"
                                    "inference: {engine: transformers}\n")
    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", cfg.name, "--run-dir", "run"], user_dir, 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished: step 3 of 3" in proc.stdout, proc.stdout[-3000:]
    metrics = [json.loads(line) for line in (user_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(any(k.startswith("rewards/correct") for k in m) for m in metrics)
    # 2 prompts a step (8 completions, 4 each) of the mixture's 8 rows (5 + 3): a quarter epoch.
    assert metrics[0]["epoch"] == 0.25
    seen = [json.loads(line) for line in (user_dir / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(seen) == 24 and {row["prompt"] for row in seen} <= set(EXPECTED)
    assert any(row["rewards"]["correct"] == 1.0 for row in seen)     # the answer column reached the reward
