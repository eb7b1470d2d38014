"""DAPO-Math and eval-set loaders: every file format and field variant, dedup, malformed-row accounting."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from triage_jax.data import DataError, MathExample, load_dapo_math, load_eval_set
from triage_jax.data.sources import EVAL_SETS, iter_rows
from triage_jax.data.templates import dapo_template


def _write_jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def _write_parquet(path, rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist alone takes the first row's keys
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    return path


def _dapo_row(problem, answer, index=None, chat=True):
    content = dapo_template(problem)
    row = {"data_source": "math_dapo",
           "prompt": [{"role": "user", "content": content}] if chat else content,
           "ability": "MATH",
           "reward_model": {"ground_truth": answer, "style": "rule-lapse"}}
    if index is not None:
        row["extra_info"] = {"index": index}
    return row


def test_dapo_parquet_chat_prompts_dedup_and_uids(tmp_path):
    rows = [_dapo_row("What is 1+1?", "2", "a"), _dapo_row("What is 2+2?", "4", "b"),
            _dapo_row("What is 1+1?", "2", "c"), _dapo_row("What is 1+1?", "3", "d"),  # dup, conflicting dup
            _dapo_row("What is 3+3?", "6", "e")]
    res = load_dapo_math(_write_parquet(tmp_path / "dapo.parquet", rows))
    assert [e.ground_truth for e in res.examples] == ["2", "4", "6"]
    assert res.examples[0] == MathExample(prompt=dapo_template("What is 1+1?"), ground_truth="2", source="dapo",
                                          uid="dapo-a")
    s = res.stats
    assert (s.rows, s.kept, s.duplicates, s.conflicting_duplicates, s.malformed) == (5, 3, 2, 1, 0)


def test_dapo_jsonl_string_prompts_and_system_message(tmp_path):
    rows = [_dapo_row("P1", "1", chat=False),
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "P2"}],
             "reward_model": {"ground_truth": "\\frac{1}{2}"}},
            {"prompt": "P3", "reward_model": json.dumps({"ground_truth": 12})}]  # JSON-encoded struct, int answer
    res = load_dapo_math(_write_jsonl(tmp_path / "dapo.jsonl", rows))
    assert [(e.prompt, e.ground_truth) for e in res.examples] == [
        (dapo_template("P1"), "1"), ("P2", "\\frac{1}{2}"), ("P3", "12")]
    assert [e.uid for e in res.examples] == ["dapo-0", "dapo-1", "dapo-2"]


def _dapo_with_bad_rows(tmp_path, n_good):
    good = [_dapo_row(f"Problem {i}", str(i)) for i in range(n_good)]
    bad = [{"prompt": "no reward"},                                           # missing reward_model
           {"prompt": "", "reward_model": {"ground_truth": "1"}},              # empty prompt
           {"prompt": [{"role": "assistant", "content": "x"}], "reward_model": {"ground_truth": "1"}},  # no user
           {"prompt": "P", "reward_model": {"ground_truth": None}},           # null answer
           {"reward_model": {"ground_truth": "1"}},                            # no prompt
           [1, 2, 3]]                                                          # not a record
    return _write_jsonl(tmp_path / "mixed.jsonl", good + bad, extra_lines=["{not json"])


def test_malformed_rows_are_skipped_and_counted_under_threshold(tmp_path):
    res = load_dapo_math(_dapo_with_bad_rows(tmp_path, 93), max_malformed_fraction=0.1)
    assert res.stats.rows == 100 and res.stats.malformed == 7 and res.stats.kept == 93
    assert res.stats.malformed_fraction == pytest.approx(0.07)
    assert any("reward_model.ground_truth" in r for r in res.stats.malformed_reasons)


def test_malformed_rows_past_threshold_fail_with_counts(tmp_path):
    path = _dapo_with_bad_rows(tmp_path, 93)
    with pytest.raises(DataError, match=r"7 of 100 rows are malformed .*max_malformed_fraction=5\.0%"):
        load_dapo_math(path, max_malformed_fraction=0.05)
    with pytest.raises(ValueError, match="max_malformed_fraction"):
        load_dapo_math(path, max_malformed_fraction=1.5)


def test_dapo_limit_and_missing_or_unknown_files(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", [_dapo_row(f"P{i}", str(i)) for i in range(10)])
    assert len(load_dapo_math(path, limit=4).examples) == 4
    with pytest.raises(DataError, match="not found"):
        load_dapo_math(tmp_path / "missing.parquet")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="format"):
        load_dapo_math(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_dapo_math(tmp_path / "empty.jsonl")


def test_gsm8k_hash_answers(tmp_path):
    rows = [{"question": "Q1", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "Q2", "answer": "lots\n#### 1,234"},
            {"question": "Q3", "answer": "no final marker"}]
    res = load_eval_set("gsm8k", _write_jsonl(tmp_path / "gsm8k.jsonl", rows), max_malformed_fraction=0.5)
    assert [(e.prompt, e.ground_truth, e.uid) for e in res.examples] == [
        (dapo_template("Q1"), "7", "gsm8k-0"), (dapo_template("Q2"), "1234", "gsm8k-1")]
    assert res.stats.malformed == 1 and "####" in res.stats.malformed_reasons[0]


def test_math500_json_list_with_unique_ids(tmp_path):
    rows = [{"problem": "Find x.", "answer": "\\frac{1}{2}", "unique_id": "test/algebra/1.json"},
            {"problem": "Find y.", "answer": "3"}]
    (tmp_path / "math500.json").write_text(json.dumps(rows))
    res = load_eval_set("math500", tmp_path / "math500.json", template="raw")
    assert [(e.prompt, e.ground_truth, e.uid, e.source) for e in res.examples] == [
        ("Find x.", "\\frac{1}{2}", "math500-test/algebra/1.json", "math500"), ("Find y.", "3", "math500-1",
                                                                                "math500")]


def test_json_object_files(tmp_path):
    (tmp_path / "cols.json").write_text(json.dumps({"problem": ["A", "B"], "answer": ["1", "2"]}))
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"problem": "A", "answer": "1"}]}))
    assert [e.ground_truth for e in load_eval_set("math500", tmp_path / "cols.json").examples] == ["1", "2"]
    assert [e.ground_truth for e in load_eval_set("math500", tmp_path / "wrapped.json").examples] == ["1"]


def test_aime2024_parquet_capitalized_fields_int_answers(tmp_path):
    rows = [{"ID": "2024-I-1", "Problem": "AIME one", "Solution": "...", "Answer": 204},
            {"ID": "2024-I-2", "Problem": "AIME two", "Solution": "...", "Answer": 25}]
    res = load_eval_set("aime2024", _write_parquet(tmp_path / "aime24.parquet", rows))
    assert [(e.prompt, e.ground_truth, e.uid) for e in res.examples] == [
        (dapo_template("AIME one"), "204", "aime2024-2024-I-1"), (dapo_template("AIME two"), "25",
                                                                  "aime2024-2024-I-2")]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_aime2025_lowercase_and_question_fields(tmp_path, fmt):
    rows = [{"problem": "P1", "answer": "70"}, {"question": "P2", "answer": "588"}]
    path = tmp_path / f"aime25.{fmt}"
    if fmt == "jsonl":
        _write_jsonl(path, rows)
    else:
        _write_parquet(path, rows)
    res = load_eval_set("aime2025", path, template="raw")
    assert [(e.prompt, e.ground_truth) for e in res.examples] == [("P1", "70"), ("P2", "588")]


def test_amc2023_question_field_and_float_answers(tmp_path):
    rows = [{"id": 0, "question": "AMC one", "answer": 27.0}, {"id": 1, "problem": "AMC two", "answer": 2.5},
            {"id": 2, "question": "AMC three", "answer": float("nan")}]
    res = load_eval_set("amc2023", _write_parquet(tmp_path / "amc.parquet", rows), template="short",
                        max_malformed_fraction=0.4)
    assert [(e.prompt, e.ground_truth, e.uid) for e in res.examples] == [
        ("Q: AMC one A:", "27", "amc2023-0"), ("Q: AMC two A:", "2.5", "amc2023-1")]
    assert res.stats.malformed == 1


def test_eval_registry_and_wrong_field_types(tmp_path):
    assert set(EVAL_SETS) == {"gsm8k", "math500", "aime2024", "aime2025", "amc2023"}
    with pytest.raises(ValueError, match="known eval sets"):
        load_eval_set("mmlu", tmp_path / "x.jsonl")
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"problem": 5, "answer": "1"}, {"problem": "ok", "answer": [1]}])
    with pytest.raises(DataError, match=r"2 of 2 rows.*problem field 'problem' is int"):
        load_eval_set("math500", path)


def test_iter_rows_reads_parquet_in_batches(tmp_path):
    rows = [{"problem": f"P{i}", "answer": str(i)} for i in range(20000)]
    path = _write_parquet(tmp_path / "big.parquet", rows)
    assert list(iter_rows(path)) == rows
