"""Bundled synthetic math task: integer arithmetic word problems at six difficulty levels, offline and seeded.

Problem i of seed s depends only on (s, i), so a source is an index-addressable sequence (a grain data source)
of any length, and the same index always renders the same problem.

  level 1  a+b, one-digit operands
  level 2  two-digit a+b or a-b (never negative)
  level 3  a*b, operands 2..12
  level 4  two steps mixing * with - or +: a*b-c, (a-b)*c, a*b+c, (a+b)*c (never negative)

The long-chain levels (LONG_LEVELS) have solutions of 64-256 BPE tokens, one step per line:

  level 5  a+b of 3..6-digit numbers, written column by column with carries
  level 6  a story of 3..4 events (buy packs, give, receive, lose, double, share), one worked sentence per event
  level 7  count up: start at a (10..39), add b (6..9) line by line until the total is over 100 (7-16 lines);
           every step reads only the previous line, so a small model learns it in minutes (the CPU organism)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from triage_jax.data.records import MathExample
from triage_jax.data.templates import get_template

LEVELS = (1, 2, 3, 4)  # the short levels: the default mixture
LONG_LEVELS = (5, 6, 7)  # step-by-step chains (the model organism's task)
ALL_LEVELS = LEVELS + LONG_LEVELS
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
    step_sep: str = ", "  # how solution_text joins the steps (one line per step for the long levels)

    def render(self, style: str) -> str:
        if style == "words":
            return self.words
        if style == "symbolic":
            return f"{self.expression}=?"
        raise ValueError(f"unknown problem style {style!r}; known styles: {list(STYLES)}")


def solution_text(problem: ArithmeticProblem) -> str:
    """Reference response for supervised warm-up: the worked steps on one line, then `Answer: <n>`."""
    return f"{problem.step_sep.join(problem.steps)}\nAnswer: {problem.answer}"


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


def _digits_rtl(n: int, width: int) -> list[int]:
    """The `width` lowest decimal digits of n, least significant first (missing digits are 0)."""
    return [(n // 10**k) % 10 for k in range(width)]


def _level5(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    """Long addition written column by column, right to left: `d1+d2+carry=s write u carry k` per column."""
    n_a, n_b = (int(v) for v in rng.integers(3, 7, size=2))
    a = int(rng.integers(10 ** (n_a - 1), 10**n_a))
    b = int(rng.integers(10 ** (n_b - 1), 10**n_b))
    width = max(n_a, n_b)
    steps, carry = [], 0
    for da, db in zip(_digits_rtl(a, width), _digits_rtl(b, width)):
        s = da + db + carry
        steps.append(f"{da}+{db}+{carry}={s} write {s % 10} carry {s // 10}")
        carry = s // 10
    if carry:
        steps.append(f"write {carry}")
    steps.append(f"{a}+{b}={a + b}")
    words = f"Add {a} and {b}."
    return ArithmeticProblem(5, "long a+b", (a, b), f"{a}+{b}", words, tuple(steps), a + b, step_sep="\n")


# The story level's lexicon (a richer vocabulary than the short levels' for the BPE tokenizer to learn).
_STORY_NAMES = (
    "Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo", "Nora",
    "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wren", "Xavier", "Yara", "Zane", "Amara",
    "Bruno", "Carmen", "Diego", "Elena", "Felix", "Greta", "Hugo", "Imani", "Jonas", "Keiko", "Luis", "Maya",
    "Nikhil", "Olga", "Pablo", "Rhea", "Stefan", "Tomas", "Ursula", "Viktor", "Willa", "Aiko", "Bashir", "Celine",
    "Dmitri", "Esther", "Farid", "Gloria", "Hamid", "Ingrid", "Jamal", "Klara", "Leopold", "Miriam", "Nadia",
    "Oscar", "Petra", "Rafael", "Svetlana", "Thabo", "Valentina", "Wojciech", "Ximena", "Yusuf", "Zofia")
_STORY_ITEMS = (
    "apples", "marbles", "pencils", "stickers", "coins", "cards", "shells", "books", "cookies", "stamps",
    "oranges", "crayons", "buttons", "beads", "candles", "erasers", "feathers", "grapes", "lemons", "muffins",
    "napkins", "pebbles", "ribbons", "seashells", "tickets", "tomatoes", "balloons", "carrots", "cupcakes",
    "flowers", "magnets", "peanuts", "puzzles", "rocks", "spoons", "toys", "walnuts", "yo-yos", "bottles", "kites",
    "acorns", "bracelets", "chestnuts", "dominoes", "envelopes", "figurines", "gumdrops", "hairpins", "jellybeans",
    "keychains", "lanterns", "mittens", "notebooks", "paintbrushes", "postcards", "raisins", "sandwiches",
    "thimbles", "umbrellas", "violins", "whistles", "bananas", "pretzels", "scarves", "sunflowers", "teacups",
    "potatoes", "cherries", "pinecones", "snowglobes")
_STORY_CONTAINERS = ("boxes", "bags", "packs", "crates", "jars", "baskets", "cartons", "tins")
_STORY_PLACES = ("market", "park", "library", "school", "beach", "museum", "garden", "station", "bakery",
                 "harbor", "zoo", "farm", "river", "stadium", "cinema", "village", "airport", "bookshop", "carnival",
                 "dentist", "festival", "greenhouse", "hospital", "lighthouse", "orchard", "playground",
                 "restaurant", "supermarket", "theater", "workshop")
_STORY_EVENTS = ("buy", "give", "receive", "lose", "double", "share")
_STORY_CAP = 500  # counts stay below this (a double past it is drawn again as another event)


def _story_event(rng: np.random.Generator, x: int, name: str, item: str) -> tuple[str, str, int, str] | None:
    """One event applied to count x: (sentence, worked step, new count, the operation as an expression template
    in which "e" stands for the expression so far), or None when it does not fit x."""
    kind = _STORY_EVENTS[int(rng.integers(0, len(_STORY_EVENTS)))]
    other = _STORY_NAMES[int(rng.integers(0, len(_STORY_NAMES)))]
    if other == name:
        other = "a friend"
    if kind == "buy":
        n, m = int(rng.integers(2, 10)), int(rng.integers(2, 13))
        box = _STORY_CONTAINERS[int(rng.integers(0, len(_STORY_CONTAINERS)))]
        if x + n * m >= _STORY_CAP:
            return None
        return (f"{name} buys {n} {box} with {m} {item} in each.",
                f"{name} buys {n}*{m}={n * m} {item}, so {name} has {x}+{n * m}={x + n * m}.", x + n * m,
                f"(e)+{n}*{m}")
    if kind in ("give", "lose"):
        if x < 2:
            return None
        n = int(rng.integers(1, min(x, 40) + 1))
        if kind == "give":
            sentence, what = f"{name} gives {n} {item} to {other}.", "gives away"
        else:
            place = _STORY_PLACES[int(rng.integers(0, len(_STORY_PLACES)))]
            sentence, what = f"{name} loses {n} {item} at the {place}.", "loses"
        return sentence, f"{name} {what} {n}, so {name} has {x}-{n}={x - n}.", x - n, f"(e)-{n}"
    if kind == "receive":
        n = int(rng.integers(1, 41))
        if x + n >= _STORY_CAP:
            return None
        return (f"{other} gives {name} {n} more {item}.", f"{name} gets {n}, so {name} has {x}+{n}={x + n}.", x + n,
                f"(e)+{n}")
    if kind == "double":
        if 2 * x >= _STORY_CAP:
            return None
        return (f"{name} doubles the {item}.", f"{name} doubles them, so {name} has {x}*2={2 * x}.", 2 * x,
                "(e)*2")
    divisors = [d for d in range(2, 7) if x % d == 0 and x > 0]
    if not divisors:
        return None
    d = divisors[int(rng.integers(0, len(divisors)))]
    return (f"{name} shares the {item} equally among {d} friends and keeps one share.",
            f"{name} keeps one share, so {name} has {x}/{d}={x // d}.", x // d, f"(e)/{d}")


def _level6(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    """A story of 3..4 events on one count; the solution works one event per line."""
    name = _STORY_NAMES[int(rng.integers(0, len(_STORY_NAMES)))]
    item = _STORY_ITEMS[int(rng.integers(0, len(_STORY_ITEMS)))]
    x = start = int(rng.integers(10, 61))
    n_events = int(rng.integers(3, 5))
    sentences, steps, expression = [f"{name} has {x} {item}."], [f"{name} starts with {x} {item}."], str(x)
    while len(steps) <= n_events:
        event = _story_event(rng, x, name, item)
        if event is not None:
            sentences.append(event[0])
            steps.append(event[1])
            x = event[2]
            expression = event[3].replace("e", expression)
    words = " ".join(sentences) + f" How many {item} does {name} have now?"
    return ArithmeticProblem(6, f"story{n_events}", (start,), expression, words, tuple(steps), x, step_sep="\n")


COUNT_UP_LIMIT = 100  # level 7 adds until the total is over this


def _level7(rng: np.random.Generator, name: str, item: str) -> ArithmeticProblem:
    """Count up: `x+b=y` per line from a until y > COUNT_UP_LIMIT; each line depends only on the one before."""
    a, b = int(rng.integers(10, 40)), int(rng.integers(6, 10))
    steps, x = [], a
    while x <= COUNT_UP_LIMIT:
        steps.append(f"{x}+{b}={x + b}")
        x += b
    words = f"Start at {a} and add {b} until the total is over {COUNT_UP_LIMIT}."
    return ArithmeticProblem(7, "count up", (a, b), f"{a}+{b}*{len(steps)}", words, tuple(steps), x, step_sep="\n")


_MAKERS = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5, 6: _level6, 7: _level7}


def _check_levels(levels: Sequence[int]) -> tuple[int, ...]:
    levels = tuple(int(v) for v in levels)
    if not levels or any(v not in _MAKERS for v in levels):
        raise ValueError(f"synthetic levels must be a non-empty subset of {list(ALL_LEVELS)}, got {list(levels)}")
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
