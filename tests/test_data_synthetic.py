"""Synthetic math task: deterministic, correct answers, learnable short format, templates."""

import re

import pytest

from triage_jax.data import rewards, templates
from triage_jax.data.synthetic import (LEVELS, LONG_LEVELS, SyntheticMathSource, make_problem, solution_text,
                                      synthetic_examples)
from triage_jax.data.tokenizers import CharTokenizer

_STEP = re.compile(r"^(\d+)([-+*])(\d+)=(\d+)$")


def _eval_expression(expr: str) -> int:
    assert re.fullmatch(r"[\d+\-*()]+", expr), expr
    return eval(expr)  # noqa: S307 - digits, + - * and parentheses only (checked above)


def test_same_seed_same_examples_and_other_seed_differs():
    a = synthetic_examples(50, seed=7)
    assert a == synthetic_examples(50, seed=7)
    assert [e.prompt for e in a] != [e.prompt for e in synthetic_examples(50, seed=8)]


def test_problem_depends_only_on_seed_and_index():
    short, long = SyntheticMathSource(10, seed=3), SyntheticMathSource(1000, seed=3)
    assert [short[i] for i in range(10)] == [long[i] for i in range(10)]
    assert long[-1] == long[999]
    with pytest.raises(IndexError):
        short.problem(10)


@pytest.mark.parametrize("level", LEVELS)
def test_answers_are_the_expression_value_and_steps_are_true(level):
    src = SyntheticMathSource(200, seed=11, levels=(level,))
    for i in range(len(src)):
        p = src.problem(i)
        assert p.level == level
        assert p.answer == _eval_expression(p.expression) >= 0
        assert src[i].ground_truth == str(p.answer)
        assert len(p.steps) == (2 if level == 4 else 1)
        for step in p.steps:
            a, op, b, c = _STEP.match(step).groups()
            assert _eval_expression(f"{a}{op}{b}") == int(c)
        assert p.steps[-1].endswith(f"={p.answer}")


def test_levels_mix_and_level4_is_multistep_with_mul_and_sub():
    src = SyntheticMathSource(400, seed=0)
    assert {src.problem(i).level for i in range(len(src))} == set(LEVELS)
    forms = {src.problem(i).form for i in range(len(src)) if src.problem(i).level == 4}
    assert forms == {"a*b-c", "(a-b)*c", "a*b+c", "(a+b)*c"}


def test_reference_solution_earns_the_dapo_reward_and_wrong_one_does_not():
    src = SyntheticMathSource(100, seed=5)
    for i in range(len(src)):
        prompt, target = src.sft_pair(i)
        assert target == solution_text(src.problem(i))
        assert target.endswith(f"\nAnswer: {src[i].ground_truth}")
        assert rewards.dapo_reward(target, src[i].ground_truth) == 1.0
        wrong = target.rsplit("Answer:", 1)[0] + f"Answer: {int(src[i].ground_truth) + 1}"
        assert rewards.dapo_reward(wrong, src[i].ground_truth) == -1.0


def test_default_template_is_dapo_with_word_problem():
    ex = SyntheticMathSource(5, seed=1)[0]
    assert ex.prompt.startswith("Solve the following math problem step by step. The last line of your response "
                                "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                                "answer to the problem.\n\n")
    assert ex.prompt.endswith('\n\nRemember to put your answer on its own line after "Answer:".')
    assert "How many" in ex.prompt


def test_short_template_is_compact_and_char_encodable():
    tok = CharTokenizer()
    src = SyntheticMathSource(300, seed=2, template="short")
    for i in range(len(src)):
        prompt, target = src.sft_pair(i)
        assert re.fullmatch(r"Q: [\d+\-*()]+=\? A:", prompt), prompt
        assert tok.decode(tok.encode(prompt + target)) == prompt + target
        assert len(prompt) + len(target) <= 64  # tiny character models see short sequences


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="levels"):
        SyntheticMathSource(5, levels=(8,))
    with pytest.raises(ValueError, match="unknown prompt template"):
        SyntheticMathSource(5, template="nope")
    with pytest.raises(ValueError, match="style"):
        SyntheticMathSource(5, style="latex")
    with pytest.raises(ValueError, match="positive"):
        SyntheticMathSource(0)
    with pytest.raises(IndexError):
        make_problem(0, -1)


def test_template_registry():
    assert templates.apply_template("short", "3+4=?") == "Q: 3+4=? A:"
    assert templates.apply_template("raw", "x") == "x"
    assert templates.apply_template("dapo", "P") == templates.DAPO_PREFIX + "\n\nP\n\n" + templates.DAPO_SUFFIX
    with pytest.raises(ValueError, match="known templates"):
        templates.get_template("chatml")


def test_short_levels_stream_is_unchanged_by_the_long_levels():
    """Cached warm-ups and the measured tiny runs depend on the short levels' exact problems."""
    import hashlib

    src = SyntheticMathSource(400, seed=3)
    text = "".join(src[i].prompt + src.sft_pair(i)[1] for i in range(400))
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "f21d04603aa0de07"


_COLUMN = re.compile(r"^(\d)\+(\d)\+([01])=(\d+) write (\d) carry ([01])$")


def test_long_addition_columns_carry_correctly_and_end_in_the_sum():
    src = SyntheticMathSource(300, seed=4, levels=(5,), template="short", style="words")
    for i in range(len(src)):
        p = src.problem(i)
        a, b = p.operands
        assert src[i].prompt == f"Q: Add {a} and {b}. A:" and p.answer == a + b
        *columns, last = p.steps
        if columns[-1].startswith("write "):  # the final carry
            assert columns.pop() == "write 1"
        carry, written = 0, []
        for k, line in enumerate(columns):
            da, db, c_in, s, u, c_out = (int(g) for g in _COLUMN.match(line).groups())
            assert (da, db) == ((a // 10**k) % 10, (b // 10**k) % 10) and c_in == carry
            assert s == da + db + c_in and (u, c_out) == (s % 10, s // 10)
            carry = c_out
            written.append(u)
        assert len(columns) == max(len(str(a)), len(str(b)))
        assert int("".join(map(str, [carry] * carry + written[::-1]))) == a + b
        assert last == f"{a}+{b}={a + b}"
        assert solution_text(p) == "\n".join(p.steps) + f"\nAnswer: {a + b}"


_STORY_STEP = re.compile(r"(\d+)([-+*/])(\d+)=(\d+)")


def test_story_steps_chain_true_equations_to_the_answer():
    src = SyntheticMathSource(300, seed=6, levels=(6,), template="short", style="words")
    for i in range(len(src)):
        p = src.problem(i)
        assert 4 <= len(p.steps) <= 5 and p.steps[0].startswith(f"{p.words.split()[0]} starts with ")
        x = p.operands[0]
        for line in p.steps[1:]:
            eqs = _STORY_STEP.findall(line)
            for a, op, b, r in eqs:
                assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                        "/": int(a) // int(b)}[op] == int(r)
                if op == "/":
                    assert int(a) % int(b) == 0
            assert int(eqs[-1][0]) == x  # each line starts from the previous count
            x = int(eqs[-1][3])
        assert x == p.answer >= 0 and eval(p.expression) == p.answer  # noqa: S307 - digits and + - * / ( )
        assert p.words.endswith("have now?")


_COUNT_STEP = re.compile(r"^(\d+)\+(\d)=(\d+)$")


def test_count_up_adds_line_by_line_until_over_the_limit():
    from triage_jax.data.synthetic import COUNT_UP_LIMIT

    src = SyntheticMathSource(300, seed=7, levels=(7,), template="short", style="words")
    for i in range(len(src)):
        p = src.problem(i)
        a, b = p.operands
        assert src[i].prompt == f"Q: Start at {a} and add {b} until the total is over {COUNT_UP_LIMIT}. A:"
        assert 10 <= a < 40 and 6 <= b <= 9 and 7 <= len(p.steps) <= 16
        x = a
        for line in p.steps:
            assert x <= COUNT_UP_LIMIT
            u, v, w = (int(g) for g in _COUNT_STEP.match(line).groups())
            assert (u, v, w) == (x, b, x + b)
            x = w
        assert x == p.answer > COUNT_UP_LIMIT and eval(p.expression) == p.answer  # noqa: S307 - digits, + and *
        assert solution_text(p) == "\n".join(p.steps) + f"\nAnswer: {p.answer}"


@pytest.mark.parametrize("level", LONG_LEVELS)
def test_long_reference_solutions_earn_the_dapo_reward(level):
    src = SyntheticMathSource(100, seed=9, levels=(level,), template="short", style="words")
    for i in range(len(src)):
        _, target = src.sft_pair(i)
        assert target.count("\n") >= 3 and rewards.dapo_reward(target, src[i].ground_truth) == 1.0
        wrong = target.rsplit("Answer:", 1)[0] + f"Answer: {int(src[i].ground_truth) + 1}"
        assert rewards.dapo_reward(wrong, src[i].ground_truth) == -1.0
