"""Rewards: the DAPO rule (training) and math-verify (evaluation), both total functions of any input.

`dapo_reward` follows DAPO's Minerva-style checker: keep the last 300 characters of the response, take the text
after the last `Answer:`, normalize it and the ground truth the same way, +1.0 if equal else -1.0. Inputs are
length-bounded before any regex runs, and any exception scores -1.0, so no string can make a reward raise or hang.
`math_verify_reward` scores with math-verify (symbolic equivalence) under a hard deadline (a killable worker
process, <= ~1 s per response by default).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import re
import signal
import subprocess
import sys
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
        truth = _normalized_ground_truth(ground_truth)
        if not truth:  # a truth that normalizes to nothing ("$", "\\text{}") matches no answer, not an empty one
            return INCORRECT
        return CORRECT if normalize_final_answer(extracted) == truth else INCORRECT
    except Exception:  # noqa: BLE001 - a reward must be total
        logger.debug("dapo_reward failed; scoring -1", exc_info=True)
        return INCORRECT


# ------------------------------------------------------------------------------------- math-verify
# math-verify (sympy) can run for seconds or forever on hostile answers (deep nesting, power towers), and a
# deadline raised by a signal can be swallowed ("Exception ignored") when it fires inside a garbage-collector
# callback. So the bound is enforced three ways: (1) a pre-parse limit rejects over-deep nesting and power towers
# in microseconds; (2) the parse+verify runs in a worker process under its own SIGALRM deadline; (3) the parent
# waits at most timeout + MATH_VERIFY_KILL_MARGIN_S and then kills the worker (a spare, already warm, takes over
# at once). One response costs at most ~timeout + margin, whatever it contains.
MATH_VERIFY_TIMEOUT_S = 0.75
MATH_VERIFY_KILL_MARGIN_S = 0.2
MATH_VERIFY_TAIL_CHARS = 4096  # answers sit at the end; the tail bounds parsing cost
MATH_VERIFY_MAX_NESTING = 32  # brackets ( [ { nested deeper than this: no real answer, a parser trap
MATH_VERIFY_MAX_TOWER = 2  # a^{b^{c}} is height 2; 10^{10^{10^{10}}} (height 3) would be evaluated by sympy
_WORKER_START_S = 120.0  # a fresh worker imports math-verify (sympy) once


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; here that is by design (our deadline replaces them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


class _Deadline(BaseException):
    """Raised by the SIGALRM handler; a BaseException so library `except Exception` blocks cannot swallow it."""


def too_hostile(text: str) -> bool:
    """Whether `text` nests brackets deeper than MATH_VERIFY_MAX_NESTING or stacks powers higher than
    MATH_VERIFY_MAX_TOWER (linear time; checked before anything parses it)."""
    depth = 0
    exp_levels: list[int] = []  # per open bracket: the power level inside it
    level = 0
    pending_exp = False
    for ch in text:
        if ch in "({[":
            depth += 1
            if depth > MATH_VERIFY_MAX_NESTING:
                return True
            exp_levels.append(level)
            if pending_exp:
                level += 1
                if level > MATH_VERIFY_MAX_TOWER:
                    return True
            pending_exp = False
        elif ch in ")}]":
            depth = max(depth - 1, 0)
            level = exp_levels.pop() if exp_levels else 0
            pending_exp = False
        elif ch == "^":
            if pending_exp:  # a^^b
                continue
            pending_exp = True
            if level + 1 > MATH_VERIFY_MAX_TOWER:
                return True
        elif not ch.isspace():
            pending_exp = False
    return False


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


def _serve(read_fd: int, write_fd: int) -> None:
    """Worker process: import math-verify, say ready, then answer (response, truth, timeout) requests."""
    from multiprocessing.connection import Connection

    rx, tx = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    import math_verify  # noqa: F401 - the slow import, once

    tx.send("ready")
    while True:
        try:
            response, truth, timeout_s = rx.recv()
        except (EOFError, OSError):
            return
        try:
            ok = _run_with_alarm(functools.partial(_math_verify_equal, response, truth), timeout_s)
        except BaseException:  # noqa: BLE001 - _Deadline or any failure scores incorrect; the worker lives on
            ok = False
        try:
            tx.send(bool(ok))
        except (EOFError, OSError):
            return


class _Worker:
    """One math-verify worker: a fresh interpreter (`python -c`, so neither JAX's threads nor the caller's
    `__main__` are inherited) talking over two pipes."""

    def __init__(self):
        from multiprocessing.connection import Connection

        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        code = f"from triage_jax.data.rewards import _serve; _serve({req_r}, {rep_w})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
                                     close_fds=True)
        os.close(req_r)
        os.close(rep_w)
        self.tx, self.rx = Connection(req_w, readable=False), Connection(rep_r, writable=False)
        self.ready = False

    def wait_ready(self, timeout_s: float) -> bool:
        if not self.ready and self.rx.poll(timeout_s):
            try:
                self.ready = self.rx.recv() == "ready"
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def ask(self, response: str, truth: str, timeout_s: float) -> bool | None:
        """The verdict, or None when the worker overran its deadline (then it is killed)."""
        try:
            self.tx.send((response, truth, timeout_s))
            if self.rx.poll(timeout_s + MATH_VERIFY_KILL_MARGIN_S):
                return bool(self.rx.recv())
        except (EOFError, OSError):
            pass
        self.kill()
        return None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(1.0)
        except Exception:  # noqa: BLE001
            pass
        for c in (self.tx, self.rx):
            try:
                c.close()
            except OSError:
                pass


_pool_lock = threading.Lock()
_workers: list[_Worker] = []  # [active, spare]: a killed worker is replaced by the warm spare at once


def _active_worker() -> _Worker:
    while len(_workers) < 2:
        _workers.append(_Worker())
    w = _workers[0]
    if not w.wait_ready(_WORKER_START_S):
        w.kill()
        _workers.pop(0)
        raise RuntimeError("math-verify worker failed to start")
    return w


def _retire(w: _Worker) -> None:
    if w in _workers:
        _workers.remove(w)
    _workers.append(_Worker())  # the new spare warms up in the background


def shutdown_workers() -> None:
    """Stop the math-verify worker processes (they also die with this process)."""
    with _pool_lock:
        while _workers:
            _workers.pop().kill()


atexit.register(shutdown_workers)


def math_verify_equal(response: str, ground_truth: str, *, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Whether math-verify finds the response's final answer equivalent to the ground truth; False on any failure,
    on a hostile answer (`too_hostile`) or when `timeout_s` passes (hard bound: timeout_s + kill margin)."""
    try:
        if not isinstance(response, str) or not isinstance(ground_truth, str) or not ground_truth.strip():
            return False
        if len(ground_truth) > MAX_GROUND_TRUTH_CHARS:
            return False
        tail = response[-MATH_VERIFY_TAIL_CHARS:]
        if too_hostile(tail) or too_hostile(ground_truth):
            logger.debug("math_verify: answer nests too deep; scoring incorrect")
            return False
        with _pool_lock:
            w = _active_worker()
            ok = w.ask(tail, ground_truth, timeout_s)
            if ok is None:
                logger.debug("math_verify overran %.2fs; worker killed, scoring incorrect", timeout_s)
                _retire(w)
                return False
            return ok
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
