"""Bundled synthetic math task: integer arithmetic word problems at four difficulty levels, offline and seeded.

Problem i of seed s depends only on (s, i), so a source is an index-addressable sequence (a grain data source)
of any length, and the same index always renders the same problem.

  level 1  a+b, one-digit operands
  level 2  two-digit a+b or a-b (never negative)
  level 3  a*b, operands 2..12
  level 4  two steps mixing * with - or +: a*b-c, (a-b)*c, a*b+c, (a+b)*c (never negative)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from triage_jax.data.records import MathExample
from triage_jax.data.templates import get_template

LEVELS = (1, 2, 3, 4)
STYLES = ("words", "symbolic")
# The style each template reads best with; other templates default to words.
DEFAULT_STYLE = {"short": "symbolic"}

_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena")
_ITEMS = ("apples", "marbles", "pencils", "stickers", "coins", "cards", "shells", "books", "cookies", "stamps")


@dataclasses.dataclass(frozen=True)
class ArithmeticProblem:
    """One problem: its two renderings, the worked steps and the integer answer."""

    level: int
    form: str
    operands: tuple[int, ...]
    expression: str
    words: str
    steps: tuple[str, ...]
    answer: int

    def render(self, style: str) -> str:
        if style == "words":
            return self.words
        if style == "symbolic":
            return f"{self.expression}=?"
        raise ValueError(f"unknown problem style {style!r}; known styles: {list(STYLES)}")


def solution_text(problem: ArithmeticProblem) -> str:
    """Reference response for supervised warm-up: the worked steps on one line, then `Answer: <n>`."""
    return f"{', '.join(problem.steps)}\nAnswer: {problem.answer}"


def _level1(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    a, b = (int(v) for v in rng.integers(0, 10, size=2))
    words = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
    return ArithmeticProblem(1, "a+b", (a, b), f"{a}+{b}", words, (f"{a}+{b}={a + b}",), a + b)


def _level2(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    a, b = (int(v) for v in rng.integers(10, 100, size=2))
    if rng.integers(0, 2) == 0:
        words = f"{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?"
        return ArithmeticProblem(2, "a+b", (a, b), f"{a}+{b}", words, (f"{a}+{b}={a + b}",), a + b)
    a, b = max(a, b), min(a, b)
    words = f"{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?"
    return ArithmeticProblem(2, "a-b", (a, b), f"{a}-{b}", words, (f"{a}-{b}={a - b}",), a - b)


def _level3(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    a, b = (int(v) for v in rng.integers(2, 13, size=2))
    words = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"
    return ArithmeticProblem(3, "a*b", (a, b), f"{a}*{b}", words, (f"{a}*{b}={a * b}",), a * b)


def _level4(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    form = ("a*b-c", "(a-b)*c", "a*b+c", "(a+b)*c")[int(rng.integers(0, 4))]
    a, b, c = (int(v) for v in rng.integers(2, 13, size=3))
    if form == "a*b-c":
        p = a * b
        c = int(rng.integers(1, p + 1))
        words = (f"{name} buys {a} boxes with {b} {item} in each box and gives away {c} {item}. "
                 f"How many {item} does {name} have left?")
        steps = (f"{a}*{b}={p}", f"{p}-{c}={p - c}")
        return ArithmeticProblem(4, form, (a, b, c), f"{a}*{b}-{c}", words, steps, p - c)
    if form == "(a-b)*c":
        a, b = max(a, b), min(a, b)
        d = a - b
        words = (f"{name} has {a} bags and loses {b} of them. Each bag left holds {c} {item}. "
                 f"How many {item} are in the bags {name} has left?")
        steps = (f"{a}-{b}={d}", f"{d}*{c}={d * c}")
        return ArithmeticProblem(4, form, (a, b, c), f"({a}-{b})*{c}", words, steps, d * c)
    if form == "a*b+c":
        p = a * b
        words = (f"{name} buys {a} boxes with {b} {item} in each box and finds {c} more {item}. "
                 f"How many {item} does {name} have now?")
        steps = (f"{a}*{b}={p}", f"{p}+{c}={p + c}")
        return ArithmeticProblem(4, form, (a, b, c), f"{a}*{b}+{c}", words, steps, p + c)
    s = a + b
    words = (f"{name} has {a} bags and buys {b} more bags. Each bag holds {c} {item}. "
             f"How many {item} does {name} have in all?")
    steps = (f"{a}+{b}={s}", f"{s}*{c}={s * c}")
    return ArithmeticProblem(4, form, (a, b, c), f"({a}+{b})*{c}", words, steps, s * c)


_MAKERS = {1: _level1, 2: _level2, 3: _level3, 4: _level4}


def _check_levels(levels: Sequence[int]) -> tuple[int, ...]:
    levels = tuple(int(v) for v in levels)
    if not levels or any(v not in _MAKERS for v in levels):
        raise ValueError(f"synthetic levels must be a non-empty subset of {list(LEVELS)}, got {list(levels)}")
    return levels


def make_problem(seed: int, index: int, levels: Sequence[int] = LEVELS) -> ArithmeticProblem:
    """Problem `index` of the stream for `seed`: the level is drawn uniformly from `levels`."""
    levels = _check_levels(levels)
    if index < 0:
        raise IndexError(f"synthetic problem index must be >= 0, got {index}")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index)])
    level = levels[int(rng.integers(0, len(levels)))]
    name = _NAMES[int(rng.integers(0, len(_NAMES)))]
    item = _ITEMS[int(rng.integers(0, len(_ITEMS)))]
    return _MAKERS[level](rng, name, item)


class SyntheticMathSource(Sequence[MathExample]):
    """`num_examples` synthetic problems as MathExamples in a named template; a grain-compatible data source."""

    def __init__(self, num_examples: int, *, seed: int = 0, levels: Sequence[int] = LEVELS,
                 template: str = "dapo", style: str | None = None):
        if num_examples <= 0:
            raise ValueError(f"synthetic num_examples must be positive, got {num_examples}")
        self.num_examples = int(num_examples)
        self.seed = int(seed)
        self.levels = _check_levels(levels)
        self.template_name = template
        self._template = get_template(template)
        self.style = style if style is not None else DEFAULT_STYLE.get(template, "words")
        if self.style not in STYLES:
            raise ValueError(f"unknown problem style {self.style!r}; known styles: {list(STYLES)}")

    def __len__(self) -> int:
        return self.num_examples

    def problem(self, index: int) -> ArithmeticProblem:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} synthetic examples")
        return make_problem(self.seed, index, self.levels)

    def __getitem__(self, index):  # noqa: D105 - Sequence protocol
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.num_examples))]
        index = int(index)
        if index < 0:
            index += self.num_examples
        p = self.problem(index)
        return MathExample(prompt=self._template(p.render(self.style)), ground_truth=str(p.answer),
                           source=f"synthetic-L{p.level}", uid=f"synthetic-{self.seed}-{index}")

    def sft_pair(self, index: int) -> tuple[str, str]:
        """(prompt, reference solution) of example `index`, for the supervised warm-up."""
        return self[index].prompt, solution_text(self.problem(index))


def synthetic_examples(num_examples: int, *, seed: int = 0, levels: Sequence[int] = LEVELS,
                       template: str = "dapo", style: str | None = None) -> list[MathExample]:
    """The first `num_examples` of a SyntheticMathSource, materialized."""
    return list(SyntheticMathSource(num_examples, seed=seed, levels=levels, template=template, style=style))


HELD_OUT_SEED_OFFSET = 10_000  # the held-out stream of training seed s is seed s + 10_000 of the same generator


def held_out_source(num_examples: int, *, seed: int, levels: Sequence[int] = LEVELS, template: str = "dapo",
                    style: str | None = None) -> SyntheticMathSource:
    """Problems that training with `seed` never sees: another seed's stream of the same generator and levels."""
    return SyntheticMathSource(num_examples, seed=int(seed) + HELD_OUT_SEED_OFFSET, levels=levels,
                               template=template, style=style)
