"""Rewards: the DAPO rule (training) and math-verify (evaluation), both total functions of any input.

`dapo_reward` follows DAPO's Minerva-style checker: keep the last 300 characters of the response, take the text
after the last `Answer:`, normalize it and the ground truth the same way, +1.0 if equal else -1.0. Inputs are
length-bounded before any regex runs, and any exception scores -1.0, so no string can make a reward raise or hang.
`math_verify_reward` scores with math-verify (symbolic equivalence) under a hard deadline.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import dataclasses
import functools
import logging
import multiprocessing
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

CORRECT, INCORRECT = 1.0, -1.0
DAPO_TAIL_CHARS = 300  # DAPO: "the longest answer in MATH-500 has 159 characters"
# A ground truth longer than this cannot equal an answer cut from 300 characters in practice; refusing it keeps the
# quadratic `$...$` regex below bounded for any input.
MAX_GROUND_TRUTH_CHARS = 1024

# ------------------------------------------------------------------------------------- Minerva normalization
# The substitution and removal tables of the DAPO / Minerva normalizer, applied in order.
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_INLINE_MATH = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAP = tuple(re.compile(p) for p in (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})", r"(\\overline\{)(.*?)(\})"))
_BOXED = re.compile(r"(\\boxed\{)(.*)(\})")
_FRAC_SHORT = re.compile(r"(frac)([^{])(.)")
_SQRT_SHORT = re.compile(r"(sqrt)([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva/DAPO answer normalization: last `=` side, units and TeX wrappers removed, `\\fracab` expanded,
    `$` dropped and thousands separators removed from plain integers."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = _INLINE_MATH.sub(r"$\3$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub(r"\2", answer)
    answer = _BOXED.sub(r"\2", answer)
    answer = _FRAC_SHORT.sub(r"frac{\2}{\3}", answer)
    answer = _SQRT_SHORT.sub(r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(response: str) -> str | None:
    """The text after the last `Answer:` (case-insensitive) in the last 300 characters, or None."""
    matches = _ANSWER_LINE.findall(response[-DAPO_TAIL_CHARS:])
    return matches[-1] if matches else None


@functools.lru_cache(maxsize=65536)
def _normalized_ground_truth(ground_truth: str) -> str:
    return normalize_final_answer(ground_truth)  # cached: a group repeats its prompt's truth G times


def dapo_reward(response: str, ground_truth: str) -> float:
    """+1.0 if the response's last `Answer:` matches the ground truth after normalization, else -1.0. Never raises."""
    try:
        if not isinstance(response, str) or not isinstance(ground_truth, str):
            return INCORRECT
        extracted = extract_answer(response)
        if extracted is None:
            return INCORRECT
        if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
            return INCORRECT
        return CORRECT if normalize_final_answer(extracted) == _normalized_ground_truth(ground_truth) else INCORRECT
    except Exception:  # noqa: BLE001 - a reward must be total
        logger.debug("dapo_reward failed; scoring -1", exc_info=True)
        return INCORRECT


# ------------------------------------------------------------------------------------- math-verify
# math-verify's own timeouts use signal.alarm and refuse to run off the main thread, and an inner alarm(0) would
# cancel an outer one; so its timeouts stay off and one deadline guards the whole parse+verify instead: SIGALRM on
# the main thread, a killable worker process elsewhere.
MATH_VERIFY_TIMEOUT_S = 5.0
MATH_VERIFY_TAIL_CHARS = 4096  # answers sit at the end; the tail bounds parsing cost


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; here that is by design (our deadline replaces them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


class _Deadline(BaseException):
    """Raised by the SIGALRM handler; a BaseException so library `except Exception` blocks cannot swallow it."""


def _math_verify_equal(response: str, ground_truth: str) -> bool:
    from math_verify import parse, verify

    gold = parse(f"${ground_truth}$", parsing_timeout=None) if "$" not in ground_truth else []
    if not gold:
        gold = parse(ground_truth, parsing_timeout=None)
    pred = parse(response[-MATH_VERIFY_TAIL_CHARS:], parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _run_with_alarm(fn: Callable[[], bool], timeout_s: float) -> bool:
    old_handler = signal.getsignal(signal.SIGALRM)
    old_delay, _ = signal.getitimer(signal.ITIMER_REAL)

    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _Deadline()

    start = time.monotonic()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    finally:
        while True:  # retried if the alarm lands between fn's return and the disarm
            try:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old_handler)
                if old_delay > 0:  # re-arm a caller's pending timer with what is left of it
                    signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3))
                break
            except _Deadline:
                continue


def _worker_equal(response: str, ground_truth: str, timeout_s: float) -> bool:
    return _run_with_alarm(functools.partial(_math_verify_equal, response, ground_truth), timeout_s)


_pool_lock = threading.Lock()
_pool: concurrent.futures.ProcessPoolExecutor | None = None


def _get_pool() -> concurrent.futures.ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def _discard_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    for proc in list(getattr(pool, "_processes", {}).values()):
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def math_verify_equal(response: str, ground_truth: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Whether math-verify finds the response's final answer equivalent to the ground truth; False on any failure
    or when `timeout_s` passes."""
    try:
        if not isinstance(response, str) or not isinstance(ground_truth, str) or not ground_truth.strip():
            return False
        if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
            return False
        if threading.current_thread() is threading.main_thread():
            return _run_with_alarm(functools.partial(_math_verify_equal, response, ground_truth), timeout_s)
        # Off the main thread no signal can interrupt us: run in a worker process that can be killed.
        pool = _get_pool()
        future = pool.submit(_worker_equal, response, ground_truth, timeout_s)
        try:
            return bool(future.result(timeout=timeout_s + 30.0))  # slack for the worker's first import
        except (concurrent.futures.TimeoutError, concurrent.futures.process.BrokenProcessPool):
            _discard_pool(pool)
            return False
    except _Deadline:
        logger.debug("math_verify timed out after %.1fs; scoring incorrect", timeout_s)
        return False
    except Exception:  # noqa: BLE001 - a reward must be total
        logger.debug("math_verify failed; scoring incorrect", exc_info=True)
        return False


def math_verify_reward(response: str, ground_truth: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> float:
    """+1.0 if math-verify judges the response correct, else -1.0 (same scale as dapo_reward). Never raises."""
    return CORRECT if math_verify_equal(response, ground_truth, timeout_s=timeout_s) else INCORRECT


# ------------------------------------------------------------------------------------- registry and batches

REWARD_FNS: dict[str, Callable[[str, str], float]] = {
    "dapo": dapo_reward,
    "math_verify": math_verify_reward,
}


def get_reward_fn(name: str) -> Callable[[str, str], float]:
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known rewards: {sorted(REWARD_FNS)}") from None


@dataclasses.dataclass(frozen=True)
class BatchRewards:
    """Per-response rewards `[N]` (float32) and whether each response is correct `[N]` (bool)."""

    rewards: np.ndarray
    accuracy: np.ndarray


def score_batch(responses: Sequence[str], ground_truths: Sequence[str], reward: str = "dapo") -> BatchRewards:
    """Score N responses against N ground truths (repeat each prompt's truth G times for groups)."""
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_batch got {len(responses)} responses but {len(ground_truths)} ground truths")
    fn = get_reward_fn(reward)
    rewards = np.asarray([fn(r, g) for r, g in zip(responses, ground_truths)], dtype=np.float32)
    return BatchRewards(rewards=rewards, accuracy=rewards > 0)
