"""Prompt templates keyed by config string: the DAPO template (default) and a short one for tiny models."""

from __future__ import annotations

from typing import Callable

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'


def dapo_template(problem: str) -> str:
    """The DAPO-Math-17k user prompt (byte-identical layout to the dataset's)."""
    return f"{DAPO_PREFIX}\n\n{problem}\n\n{DAPO_SUFFIX}"


def short_template(problem: str) -> str:
    """A few characters of framing, so a tiny character-level model spends its context on the problem."""
    return f"Q: {problem} A:"


def raw_template(problem: str) -> str:
    """The problem text unchanged (for sources whose prompts are already templated)."""
    return problem


TEMPLATES: dict[str, Callable[[str], str]] = {
    "dapo": dapo_template,
    "short": short_template,
    "raw": raw_template,
}


def get_template(name: str) -> Callable[[str], str]:
    """The template registered under `name`; a clear error lists the known names otherwise."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise ValueError(f"unknown prompt template {name!r}; known templates: {sorted(TEMPLATES)}") from None


def apply_template(name: str, problem: str) -> str:
    return get_template(name)(problem)
