"""Synthetic math task: deterministic, correct answers, learnable short format, templates."""

import re

import pytest

from triage_jax.data import rewards, templates
from triage_jax.data.synthetic import LEVELS, SyntheticMathSource, make_problem, solution_text, synthetic_examples
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
        SyntheticMathSource(5, levels=(5,))
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
