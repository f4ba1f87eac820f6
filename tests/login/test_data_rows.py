"""Issue #26, item 8: every row's prompt is checked on the login node (hpcrl.login.data_rows, called
by hpcrl.login.inputs.check_inputs at render, submit and run). An empty or missing prompt past the
first row used to fail only on the compute nodes, after the queue, in the engine's words ("The
decoder prompt cannot be empty", "You need to specify either text or text_target")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpcrl.job.errors import UserError
from hpcrl.job.recipe import DataConfig, DataSource, GRPOConfig, Recipe
from hpcrl.job.site import Site
from hpcrl.login import data_rows, inputs

SITE = Site(name="x")
GOOD = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
CHAT = [{"prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"{i}+1="}],
         "answer": str(i + 1)} for i in range(30)]


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check(path, **data) -> None:
    inputs.check_inputs(Recipe(data=DataConfig(path=str(path), **data)), SITE)


def with_row(rows: list, index: int, row: dict) -> list:
    return rows[:index] + [row] + rows[index + 1:]


# ---------------------------------------------------------------------------- what a bad prompt is
BAD_PLAIN = [
    ("empty", {"prompt": "", "answer": "1"}, 'is empty (an empty prompt cannot be generated from)'),
    ("missing-key", {"answer": "1"}, 'is missing (every row needs a prompt to generate from)'),
    ("null", {"prompt": None, "answer": "1"}, 'is null (every row needs a prompt to generate from)'),
    ("whitespace", {"prompt": " \n\t", "answer": "1"}, "is whitespace only (' \\n\\t'; every row needs"),
    ("number", {"prompt": 7, "answer": "1"}, "is 7 (int), not text or a list of {role, content} messages"),
]
BAD_CHAT = [
    ("empty-conversation", [], "is an empty conversation (a list of no messages)"),
    ("no-content", [{"role": "user"}], "holds a message without content (message 0, role 'user')"),
    ("null-content", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}],
     "holds a message without content (message 1, role 'user')"),
    ("no-role", [{"content": "3+1="}], "holds a message without a role (message 0: {'content': '3+1='})"),
    ("not-a-message", ["3+1="], "is a list whose item 0 is '3+1=', not a {role, content} message"),
    ("ends-with-system", [{"role": "system", "content": "Be brief."}],
     "ends with a 'system' message; the last message of a prompt is a user, tool or assistant turn"),
]


@pytest.mark.parametrize("case_id,row,expect", BAD_PLAIN, ids=[c[0] for c in BAD_PLAIN])
def test_a_bad_plain_prompt_in_a_later_row(tmp_path, case_id, row, expect):
    f = write_jsonl(tmp_path / "train.jsonl", with_row(GOOD, 17, row))
    with pytest.raises(UserError) as e:
        check(f)
    assert str(e.value).startswith(f'data.path: {f} line 18: column "prompt" {expect}'), str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case_id,prompt,expect", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_a_bad_conversation_in_a_later_row(tmp_path, case_id, prompt, expect):
    f = write_jsonl(tmp_path / "chat.jsonl", with_row(CHAT, 25, {"prompt": prompt, "answer": "1"}))
    with pytest.raises(UserError) as e:
        check(f)
    assert str(e.value).startswith(f'data.path: {f} line 26: column "prompt" {expect}'), str(e.value)


def test_good_prompts_pass_in_every_form(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for name, rows in (("plain", GOOD), ("chat", CHAT)):
        check(write_jsonl(tmp_path / f"{name}.jsonl", rows))
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
        check(tmp_path / f"{name}.json")
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
        check(tmp_path / f"{name}.parquet")
    (tmp_path / "plain.csv").write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in GOOD))
    check(tmp_path / "plain.csv")
    # a role's message may be empty (the chat template still gives the model text to continue)
    check(write_jsonl(tmp_path / "quiet.jsonl", [{"prompt": [{"role": "system", "content": ""},
                                                             {"role": "user", "content": "1+1="}]}]))


# ---------------------------------------------------------------------------- every data form
def test_a_bad_row_in_each_file_form(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    bad = with_row(GOOD, 21, {"prompt": "", "answer": "1"})
    (tmp_path / "a.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match=r'^data.path: .*a.json row 21 \(0-based\): column "prompt" is empty'):
        check(tmp_path / "a.json")
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "a.parquet", row_group_size=8)
    with pytest.raises(UserError, match=r'^data.path: .*a.parquet row 21 \(0-based\): column "prompt" is empty'):
        check(tmp_path / "a.parquet")
    chat = with_row(CHAT, 9, {"prompt": [{"role": "user", "content": None}], "answer": "1"})
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "chat.parquet")
    with pytest.raises(UserError, match=r'^data.path: .*chat.parquet row 9 \(0-based\): column "prompt" holds a '
                                        r'message without content \(message 0'):
        check(tmp_path / "chat.parquet")
    pq.write_table(pa.Table.from_pylist(GOOD), tmp_path / "part-1.parquet")
    (tmp_path / "part-2.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match=r"^data.path: .*part-2.parquet: not a readable parquet file \("):
        check(tmp_path / "part-*.parquet")


def test_csv_lines_count_from_the_header_and_na_words_are_missing(tmp_path):
    """datasets' CSV builder is pandas: an empty field and words such as NA are None to the job."""
    f = tmp_path / "a.csv"
    f.write_text('prompt,answer\n1+1=,2\n"two\nlines",3\nNA,4\n')
    with pytest.raises(UserError, match=r'^data.path: .*a.csv line 5: column "prompt" is \'NA\', which datasets\' '
                                        r'CSV reader \(pandas\) takes for a missing value'):
        check(f)
    f.write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(UserError, match=r'^data.path: .*a.csv line 3: column "prompt" is empty'):
        check(f)
    datasets = pytest.importorskip("datasets")
    assert datasets.Dataset.from_csv(str(f), keep_in_memory=True)["prompt"][1] is None   # what the job would read


def test_a_missing_key_is_none_to_the_job(tmp_path):
    """The claim behind "is missing": datasets fills a JSON lines row without the key with None."""
    pytest.importorskip("datasets")
    from hpcrl.compute.train.data import load_prompts

    f = write_jsonl(tmp_path / "a.jsonl", with_row(GOOD, 3, {"answer": "4"}))
    assert load_prompts(f)["prompt"][3] is None
    with pytest.raises(UserError, match=r'^data.path: .*a.jsonl line 4: column "prompt" is missing'):
        check(f)


def test_a_saved_dataset_and_a_directory_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    bad = with_row(GOOD, 12, {"prompt": "   ", "answer": "1"})
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(GOOD),
                          "test": datasets.Dataset.from_list(bad)}).save_to_disk(str(saved))
    check(saved)
    with pytest.raises(UserError, match=r"^data.path: .*saved/test/data-00000-of-00001.arrow \(split 'test'\) row 12 "
                                        r"\(0-based\): column \"prompt\" is whitespace only"):
        check(saved, split="test")
    d = tmp_path / "d"
    write_jsonl(d / "train.jsonl", GOOD)
    write_jsonl(d / "test.jsonl", bad)
    check(d)
    with pytest.raises(UserError, match=r"^data.path: .*d/test.jsonl \(split 'test'\) line 13: column"):
        inputs.check_inputs(Recipe(data=DataConfig(path=str(d)), grpo=GRPOConfig(eval_strategy="steps")), SITE)


def test_every_file_of_a_glob_and_of_data_files(tmp_path):
    write_jsonl(tmp_path / "part-1.jsonl", GOOD)
    write_jsonl(tmp_path / "part-2.jsonl", with_row(GOOD, 2, {"prompt": None}))
    with pytest.raises(UserError, match=r'^data.path: .*part-2.jsonl line 3: column "prompt" is null'):
        check(tmp_path / "part-*.jsonl")
    recipe = Recipe(data=DataConfig(data_files=(str(tmp_path / "part-1.jsonl"), str(tmp_path / "part-2.jsonl"))))
    with pytest.raises(UserError, match=r'^data.data_files: .*part-2.jsonl line 3: column "prompt" is null'):
        inputs.check_inputs(recipe, SITE)


def test_a_mixture_names_its_source_and_the_prompt_column(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"question": r["prompt"]} for r in GOOD])
    write_jsonl(tmp_path / "b" / "train.jsonl", with_row([{"question": r["prompt"]} for r in GOOD], 29,
                                                         {"question": ""}))
    sources = (DataSource(path="json", data_files=str(tmp_path / "a.jsonl")), DataSource(path=str(tmp_path / "b")))
    recipe = Recipe(data=DataConfig(datasets=sources, prompt_column="question"))
    with pytest.raises(UserError, match=r'^data.datasets\[1\]: .*b/train.jsonl line 30: column "question" is empty'):
        inputs.check_inputs(recipe, SITE)
    inputs.check_inputs(Recipe(data=DataConfig(datasets=sources[:1], prompt_column="question")), SITE)


def test_hpcrl_submit_refuses_it_in_one_line(hpcrl, tmp_path):
    f = write_jsonl(tmp_path / "train.jsonl", with_row(GOOD, 17, {"prompt": "", "answer": "1"}))
    r = hpcrl("submit", "--site", "testbed", f"data.path={f}")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip() == (f'hpcrl: error: data.path: {f} line 18: column "prompt" is empty (an empty prompt '
                                f'cannot be generated from)'), r.stderr
    assert list(hpcrl.work.iterdir()) == []


# ---------------------------------------------------------------------------- the bound
def write_many(path: Path, n: int, bad: range = range(0)) -> Path:
    path.write_text("".join('{"prompt": ""}\n' if i in bad else f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n'
                            for i in range(n)))
    return path


def test_a_large_set_is_checked_within_the_bound(tmp_path, capsys, monkeypatch):
    n = 100_000
    f = write_many(tmp_path / "big.jsonl", n)
    start = time.perf_counter()
    check(f)
    took = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n{n} JSON lines rows checked in {took:.2f} s")
    assert took < data_rows.TIME_BUDGET_S + 1
    # Given the time, all of it is read (it is within HEAD_ROWS): a bad last row is found. The time is
    # given, because on a loaded machine (CI's two lanes) 100k rows can outlast the budget, and the
    # evenly spread sample need not land on the last line.
    monkeypatch.setattr(data_rows, "TIME_BUDGET_S", 600.0)
    write_many(f, n, bad=range(n - 1, n))
    with pytest.raises(UserError, match=rf"big.jsonl line {n}: column \"prompt\" is empty"):
        check(f)


def test_past_the_head_an_evenly_spread_sample(tmp_path, monkeypatch):
    """Beyond HEAD_ROWS a sample spread over the rest finds a bad stretch, and names its exact line."""
    monkeypatch.setattr(data_rows, "HEAD_ROWS", 1000)
    f = write_many(tmp_path / "big.jsonl", 50_000, bad=range(31_000, 31_100))
    with pytest.raises(UserError) as e:
        check(f)
    line = int(str(e.value).split(" line ")[1].split(":")[0])
    assert 31_001 <= line <= 31_100, str(e.value)
    # a table: by row index
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    prompts = [f"{i}+1=" if not 40_000 <= i < 40_050 else None for i in range(50_000)]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "big.parquet", row_group_size=4096)
    with pytest.raises(UserError, match=r"big.parquet row 400[0-4]\d \(0-based\): column \"prompt\" is null"):
        check(tmp_path / "big.parquet")
    # many shards the head never opened: sampled too
    for i in range(30):
        write_many(tmp_path / f"shard-{i:02}.jsonl", 100, bad=range(50, 60) if i == 27 else range(0))
    with pytest.raises(UserError, match=r"shard-27.jsonl line 5\d: "):
        check(tmp_path / "shard-*.jsonl")
    # a CSV file is read in order only: past the head, its rows are the job's
    f = tmp_path / "big.csv"
    f.write_text("prompt\n" + "".join(f"{i}+1=\n" if i < 1500 else "NA\n" for i in range(2000)))
    check(f)


def test_a_huge_set_stops_at_the_time_bound(tmp_path, monkeypatch):
    """Rows the head has no time left for are the job's (here with no row bound and no sample, so
    that only the time bound counts)."""
    monkeypatch.setattr(data_rows, "HEAD_ROWS", 10**9)
    monkeypatch.setattr(data_rows, "SAMPLE_ROWS", 0)
    f = write_many(tmp_path / "big.jsonl", 300_000, bad=range(250_000, 250_001))
    # Time to read it all (~1 s here alone, past the default 2 s on a machine busy with other tests).
    monkeypatch.setattr(data_rows, "TIME_BUDGET_S", 60.0)
    with pytest.raises(UserError, match=r"big.jsonl line 250001: "):
        check(f)
    monkeypatch.setattr(data_rows, "TIME_BUDGET_S", 0.05)
    start = time.perf_counter()
    check(f)                            # 0.05 s reads nowhere near line 250001
    assert time.perf_counter() - start < 0.5
