"""Task sources from local files: DAPO-Math-17k (parquet/jsonl) and the eval sets GSM8K, MATH-500, AIME 2024/2025,
AMC 2023 (jsonl/json/parquet), each with its common field variants, all yielding MathExample.

Every loader skips malformed rows and counts them, and raises DataError when the malformed fraction exceeds
`max_malformed_fraction`, so a wrong file fails loudly instead of training on a sliver of it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from triage_jax.data.records import DataError, LoadResult, LoadStats, MathExample
from triage_jax.data.templates import get_template

DEFAULT_MAX_MALFORMED_FRACTION = 0.05
_PARQUET_BATCH_ROWS = 8192


class MalformedRow(ValueError):
    """Raised by a row parser; the loader counts the row as malformed and moves on."""


# ----------------------------------------------------------------------------------------------- reading rows


def _detect_format(path: str) -> str:
    lower = path.lower()
    for ext, fmt in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json")):
        if lower.endswith(ext):
            return fmt
    raise DataError(f"cannot tell the format of {path!r}: expected a .parquet, .jsonl or .json file")


def iter_rows(path: str | os.PathLike, columns: Sequence[str] | None = None) -> Iterator[Any]:
    """Rows of a local parquet / jsonl / json file as Python objects (a bad jsonl line yields a MalformedRow).
    `columns` limits what parquet decodes (those present in the file); other formats return whole rows."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path!r}")
    fmt = _detect_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise DataError(f"cannot read parquet file {path!r}: {e}") from e
        if columns is not None:
            columns = [c for c in columns if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
            yield from batch.to_pylist()
    elif fmt == "jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    yield MalformedRow(f"invalid JSON on line {line_no}: {e.msg}")
    else:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"cannot parse JSON file {path!r}: {e}") from e
        if isinstance(data, Mapping):
            data = _json_records(data, path)
        if not isinstance(data, list):
            raise DataError(f"JSON file {path!r} must hold a list of records, got {type(data).__name__}")
        yield from data


def _json_records(data: Mapping, path: str) -> list:
    """A JSON object holding records: {"data"|"rows"|"examples": [...]} or columns {field: [values]}."""
    for key in ("data", "rows", "examples", "train", "test"):
        if isinstance(data.get(key), list):
            return data[key]
    columns = list(data.values())
    if columns and all(isinstance(c, list) for c in columns) and len({len(c) for c in columns}) == 1:
        return [dict(zip(data.keys(), vals)) for vals in zip(*columns)]
    raise DataError(f"JSON file {path!r} holds an object that is neither a record list nor equal-length columns")


def _load(path, parse_row: Callable[[Any, int], MathExample], *, source: str, dedupe: bool,
          max_malformed_fraction: float, limit: int | None, columns: Sequence[str] | None = None) -> LoadResult:
    if not 0.0 <= max_malformed_fraction <= 1.0:
        raise ValueError(f"max_malformed_fraction must be in [0, 1], got {max_malformed_fraction}")
    stats = LoadStats(path=os.fspath(path))
    examples: list[MathExample] = []
    seen: dict[str, str] = {}
    for i, row in enumerate(iter_rows(path, columns)):
        if limit is not None and len(examples) >= limit:
            break
        stats.rows += 1
        try:
            if isinstance(row, MalformedRow):
                raise row
            if not isinstance(row, Mapping):
                raise MalformedRow(f"expected a record (mapping), got {type(row).__name__}")
            ex = parse_row(row, i)
        except MalformedRow as e:
            stats.record_malformed(i, str(e))
            continue
        if dedupe:
            if ex.prompt in seen:
                stats.duplicates += 1
                stats.conflicting_duplicates += seen[ex.prompt] != ex.ground_truth
                continue
            seen[ex.prompt] = ex.ground_truth
        examples.append(ex)
    stats.kept = len(examples)
    if stats.rows == 0:
        raise DataError(f"{source} file {stats.path!r} holds no rows")
    if stats.malformed_fraction > max_malformed_fraction:
        raise DataError(
            f"{source} file {stats.path!r}: {stats.malformed} of {stats.rows} rows are malformed "
            f"({stats.malformed_fraction:.1%} > max_malformed_fraction={max_malformed_fraction:.1%}); "
            f"first problems: {'; '.join(stats.malformed_reasons)}")
    return LoadResult(examples, stats)


# ----------------------------------------------------------------------------------------------- field helpers


def _text_field(row: Mapping, keys: tuple[str, ...], what: str) -> str:
    for k in keys:
        if k in row and row[k] is not None:
            v = row[k]
            if not isinstance(v, str):
                raise MalformedRow(f"{what} field {k!r} is {type(v).__name__}, expected a string")
            if not v.strip():
                raise MalformedRow(f"{what} field {k!r} is empty")
            return v
    raise MalformedRow(f"no {what} field (looked for {list(keys)})")


def answer_to_str(v: Any, what: str = "answer") -> str:
    """A ground-truth value as a string: integers and integral floats (AMC's 27.0) print as integers."""
    if isinstance(v, bool) or v is None:
        raise MalformedRow(f"{what} is {v!r}")
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise MalformedRow(f"{what} is {v!r}")
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, str):
        if not v.strip():
            raise MalformedRow(f"{what} is empty")
        return v.strip()
    raise MalformedRow(f"{what} is {type(v).__name__}, expected a string or number")


def _answer_field(row: Mapping, keys: tuple[str, ...]) -> str:
    for k in keys:
        if k in row and row[k] is not None:
            return answer_to_str(row[k], f"answer field {k!r}")
    raise MalformedRow(f"no answer field (looked for {list(keys)})")


def _uid(row: Mapping, source: str, index: int, id_keys=("unique_id", "id", "ID", "idx", "index")) -> str:
    for k in id_keys:
        v = row.get(k)
        if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v).strip():
            return f"{source}-{v}"
    return f"{source}-{index}"


# ----------------------------------------------------------------------------------------------- DAPO-Math-17k


def _dapo_prompt(prompt: Any) -> str:
    """The user text of a DAPO prompt: a string, or the last user message of a chat-message list."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MalformedRow("prompt is empty")
        return prompt
    if hasattr(prompt, "tolist"):  # numpy arrays from pandas-written files
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise MalformedRow(f"prompt must be a string or a non-empty list of chat messages, got {prompt!r:.80}")
    user = [m for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
    if not user:
        raise MalformedRow("prompt message list has no {'role': 'user'} message")
    content = user[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise MalformedRow("user message has no non-empty string content")
    return content


def _parse_dapo_row(row: Mapping, index: int) -> MathExample:
    if "prompt" not in row:
        raise MalformedRow("no 'prompt' field")
    prompt = _dapo_prompt(row["prompt"])
    rm = row.get("reward_model")
    if isinstance(rm, str):  # jsonl files sometimes carry the struct JSON-encoded
        try:
            rm = json.loads(rm)
        except json.JSONDecodeError:
            raise MalformedRow("'reward_model' is a string that is not JSON") from None
    if not isinstance(rm, Mapping) or "ground_truth" not in rm:
        raise MalformedRow("no 'reward_model.ground_truth' field")
    gt = answer_to_str(rm["ground_truth"], "reward_model.ground_truth")
    extra = row.get("extra_info")
    uid = _uid(extra, "dapo", index) if isinstance(extra, Mapping) else f"dapo-{index}"
    return MathExample(prompt=prompt, ground_truth=gt, source="dapo", uid=uid)


def load_dapo_math(path: str | os.PathLike, *, max_malformed_fraction: float = DEFAULT_MAX_MALFORMED_FRACTION,
                   limit: int | None = None) -> LoadResult:
    """DAPO-Math-17k rows (prompt already in the DAPO template), deduplicated by prompt text (first kept)."""
    return _load(path, _parse_dapo_row, source="DAPO-Math", dedupe=True,
                 max_malformed_fraction=max_malformed_fraction, limit=limit,
                 columns=("prompt", "reward_model", "extra_info"))


# ----------------------------------------------------------------------------------------------- eval sets

_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def gsm8k_final_answer(answer: str) -> str:
    """The number after GSM8K's `####` marker, thousands separators removed."""
    m = _GSM8K_ANSWER.search(answer)
    if m is None:
        raise MalformedRow("GSM8K answer has no '#### <number>' line")
    final = m.group(1).replace(",", "").strip()
    if not final:
        raise MalformedRow("GSM8K answer is empty after '####'")
    return final


def _eval_parser(source: str, problem_keys: tuple[str, ...], answer_keys: tuple[str, ...], template: str,
                 answer_fn: Callable[[str], str] | None = None) -> Callable[[Mapping, int], MathExample]:
    apply = get_template(template)

    def parse(row: Mapping, index: int) -> MathExample:
        problem = _text_field(row, problem_keys, "problem")
        if answer_fn is None:
            gt = _answer_field(row, answer_keys)
        else:
            gt = answer_fn(_text_field(row, answer_keys, "answer"))
        return MathExample(prompt=apply(problem), ground_truth=gt, source=source, uid=_uid(row, source, index))

    return parse


# name -> (problem field variants, answer field variants, answer post-processing)
EVAL_SETS: dict[str, tuple[tuple[str, ...], tuple[str, ...], Callable[[str], str] | None]] = {
    "gsm8k": (("question", "problem"), ("answer",), gsm8k_final_answer),
    "math500": (("problem",), ("answer",), None),
    "aime2024": (("problem", "Problem", "question"), ("answer", "Answer"), None),
    "aime2025": (("problem", "Problem", "question"), ("answer", "Answer"), None),
    "amc2023": (("question", "problem", "Problem"), ("answer", "Answer"), None),
}


def load_eval_set(name: str, path: str | os.PathLike, *, template: str = "dapo",
                  max_malformed_fraction: float = DEFAULT_MAX_MALFORMED_FRACTION,
                  limit: int | None = None) -> LoadResult:
    """An eval set by name (see EVAL_SETS) from a local file, problems rendered in `template`."""
    if name not in EVAL_SETS:
        raise ValueError(f"unknown eval set {name!r}; known eval sets: {sorted(EVAL_SETS)}")
    problem_keys, answer_keys, answer_fn = EVAL_SETS[name]
    parse = _eval_parser(name, problem_keys, answer_keys, template, answer_fn)
    return _load(path, parse, source=name, dedupe=False, max_malformed_fraction=max_malformed_fraction,
                 limit=limit)


def load_gsm8k(path, **kw) -> LoadResult:
    return load_eval_set("gsm8k", path, **kw)


def load_math500(path, **kw) -> LoadResult:
    return load_eval_set("math500", path, **kw)


def load_aime2024(path, **kw) -> LoadResult:
    return load_eval_set("aime2024", path, **kw)


def load_aime2025(path, **kw) -> LoadResult:
    return load_eval_set("aime2025", path, **kw)


def load_amc2023(path, **kw) -> LoadResult:
    return load_eval_set("amc2023", path, **kw)
