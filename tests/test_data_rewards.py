"""Rewards: the DAPO rule and its normalization, math-verify under a deadline, totality on any string."""

import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triage_jax.data import rewards
from triage_jax.data.rewards import dapo_reward, math_verify_reward, normalize_final_answer, score_batch

HANG_PRED, HANG_GOLD = "\\boxed{10^{10^{10}}}", "10"  # sympy would evaluate a 10-billion-digit integer


@pytest.mark.parametrize("raw, normalized", [
    ("\\boxed{7}", "7"),
    ("$\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("10 dollars", "10"),
    ("x = 5", "5"),
    ("1,000", "1000"),
    ("1,000.5", "1,000.5"),
    ("\\text{(A)}", "(A)"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("90^\\circ", "90"),
    ("5 \\text{ cm}", "5"),
    ("\\textbf{12}", "12"),
    ("a 5", "5"),  # the Minerva table drops "a " (and "an ") everywhere
])
def test_minerva_normalization(raw, normalized):
    assert normalize_final_answer(raw) == normalized


@pytest.mark.parametrize("response, truth, expected", [
    ("3+4=7\nAnswer: 7", "7", 1.0),
    ("3+4=7\nAnswer: 8", "7", -1.0),
    ("so answer:7", "7", 1.0),                                  # case-insensitive, no space needed
    ("Answer: 7\nwait, no.\nAnswer: 8", "8", 1.0),              # the last match counts
    ("Answer: 7\nwait, no.\nAnswer: 8", "7", -1.0),
    ("x" * 10_000 + "\nAnswer: 7", "7", 1.0),
    ("Answer: 7\n" + "z" * 300, "7", -1.0),                     # outside the last 300 characters
    ("Answer: $\\boxed{1,000}$", "1000", 1.0),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: 12 apples", "12", -1.0),                          # "apples" is not among the removed units
    ("no final line", "7", -1.0),
    ("no final line", "[INVALID]", -1.0),                       # a missing answer never matches
    ("Answer: 7", "", -1.0),
])
def test_dapo_reward_rule(response, truth, expected):
    assert dapo_reward(response, truth) == expected


def test_rewards_are_total_on_non_strings():
    for bad in (None, 7, b"Answer: 7", ["Answer: 7"]):
        assert dapo_reward(bad, "7") == -1.0 and dapo_reward("Answer: 7", bad) == -1.0
        assert math_verify_reward(bad, "7") == -1.0 and math_verify_reward("Answer: 7", bad) == -1.0


ADVERSARIAL = [
    "$" * 1_000_000, "Answer:" + "$" * 1_000_000, "Answer: " + "a$" * 500_000, "Answer: " + "\\boxed{" * 200_000,
    ("Answer: " + " " * 100_000) * 10, "\n" * 1_000_000, "Answer:" * 200_000, "Answer: \\frac" * 100_000,
    "Answer: " + "{" * 100_000 + "}" * 100_000, "\x00\ud800" * 100_000, "Answer: =" * 100_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_dapo_reward_is_fast_on_huge_adversarial_strings(text):
    start = time.perf_counter()
    assert dapo_reward(text, "7") == -1.0
    assert dapo_reward("Answer: 7", text) == -1.0
    assert dapo_reward(text, text) in (1.0, -1.0)
    assert time.perf_counter() - start < 1.0


_text = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from("$\\{}=:,. \nAnswerboxedfrac"), max_size=400)
_huge = st.builds(lambda s, n: s * n, st.text(max_size=12), st.integers(0, 60_000))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=_text | _huge, truth=_text | _huge)
def test_dapo_reward_never_raises_or_stalls(response, truth):
    start = time.perf_counter()
    assert dapo_reward(response, truth) in (1.0, -1.0)
    assert dapo_reward("Answer: " + response, truth) in (1.0, -1.0)
    assert time.perf_counter() - start < 1.0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=_text | _huge, truth=st.text(max_size=30))
def test_math_verify_reward_never_raises_or_stalls(response, truth):
    math_verify_reward("1", "1")  # the worker process is started (a one-off cost, not a response's)
    start = time.perf_counter()
    assert math_verify_reward(response, truth, timeout_s=1.0) in (1.0, -1.0)
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize("response, truth, expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("Answer: 1/2", "\\frac12", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("Answer: 12", "12", 1.0),
    ("Answer: 13", "12", -1.0),
    ("nothing here", "12", -1.0),
])
def test_math_verify_reward_judges_equivalence(response, truth, expected):
    assert math_verify_reward(response, truth) == expected


def test_math_verify_deadline_on_main_thread_restores_signal_state():
    def marker(signum, frame):  # pragma: no cover - must not fire during the test
        raise AssertionError("caller's alarm fired early")

    old = signal.signal(signal.SIGALRM, marker)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        start = time.perf_counter()
        assert math_verify_reward(HANG_PRED, HANG_GOLD, timeout_s=1.0) == -1.0
        assert time.perf_counter() - start < 2.5
        assert signal.getsignal(signal.SIGALRM) is marker
        assert 25.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0  # the caller's timer is still pending
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_math_verify_off_the_main_thread_uses_a_killable_worker():
    out = {}

    def work():
        out["right"] = math_verify_reward("\\boxed{0.5}", "\\frac{1}{2}")
        start = time.perf_counter()
        out["hang"] = math_verify_reward(HANG_PRED, HANG_GOLD, timeout_s=1.0)
        out["hang_s"] = time.perf_counter() - start
        out["after"] = math_verify_reward("Answer: 3", "3")

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive()
    assert (out["right"], out["hang"], out["after"]) == (1.0, -1.0, 1.0)
    assert out["hang_s"] < 10.0


def test_score_batch_and_registry():
    res = score_batch(["Answer: 7", "Answer: 8", "junk"], ["7", "7", "7"])
    assert res.rewards.dtype == np.float32 and res.accuracy.dtype == np.bool_
    np.testing.assert_array_equal(res.rewards, [1.0, -1.0, -1.0])
    np.testing.assert_array_equal(res.accuracy, [True, False, False])
    mv = score_batch(["\\boxed{0.5}"], ["1/2"], reward="math_verify")
    np.testing.assert_array_equal(mv.accuracy, [True])
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        score_batch(["a", "b"], ["7"])
    with pytest.raises(ValueError, match="known rewards"):
        rewards.get_reward_fn("bleu")


HOSTILE = {
    "parens1000": "Answer: $" + "(" * 1000 + "1" + ")" * 1000 + "$",
    "parens2000": "Answer: $" + "(" * 2000 + "1" + ")" * 2000 + "$",
    "braces1500": "\\boxed{" + "{" * 1500 + "1" + "}" * 1500 + "}",
    "tower3": "$\\boxed{10^{10^{10}}}$",
    "tower4": "The answer is $\\boxed{10^{10^{10^{10}}}}$",
    "tower5": "$\\boxed{9^{9^{9^{9^{9}}}}}$",
    "factorial": "$\\boxed{(10^{10})!}$",
}


def _warm():
    assert math_verify_reward("\\boxed{3}", "3") == 1.0  # the worker's one-time import is not a response's cost


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_math_verify_hostile_answers_cost_at_most_a_second(name):
    """Before: 5 s (the old default) to 16 s per answer. Now <= timeout + kill margin (~0.95 s)."""
    _warm()
    start = time.perf_counter()
    assert math_verify_reward(HOSTILE[name], "7") == -1.0
    assert time.perf_counter() - start <= 1.0
    assert rewards.MATH_VERIFY_TIMEOUT_S + rewards.MATH_VERIFY_KILL_MARGIN_S <= 1.0


def test_pre_parse_limit():
    assert rewards.too_hostile("(" * 40 + ")" * 40) and rewards.too_hostile("10^{10^{10^{10}}}")
    assert not rewards.too_hostile("\\frac{x^{2}+1}{(x+1)^{2}}") and not rewards.too_hostile("2^{3^{2}}")


def test_math_verify_deadline_holds_when_the_alarm_is_swallowed(monkeypatch):
    """A deadline that never arrives inside the worker (here SIGALRM is blocked there, as when the exception
    is swallowed in a GC callback) still ends at timeout + margin: the parent kills the worker, the warm spare
    answers the next response."""
    monkeypatch.setattr(rewards, "MATH_VERIFY_MAX_NESTING", 10**9)  # let the parser trap through
    rewards.shutdown_workers()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        _warm()  # workers spawned now inherit the blocked SIGALRM
        time.sleep(0.5)  # (the spare too)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    start = time.perf_counter()
    assert math_verify_reward(HOSTILE["parens2000"], "7", timeout_s=0.5) == -1.0
    assert time.perf_counter() - start <= 0.5 + rewards.MATH_VERIFY_KILL_MARGIN_S + 0.3
    assert math_verify_reward("Answer: 1/2", "\\frac12") == 1.0
    rewards.shutdown_workers()  # do not leave workers with a blocked SIGALRM to later tests


def test_empty_normalized_truth_never_matches():
    # Before: "\\text{}" and "$" both normalize to "", so an empty answer scored +1.
    assert normalize_final_answer("\\text{}") == "" and normalize_final_answer("$") == ""
    assert dapo_reward("Answer: $", "\\text{}") == -1.0
    assert dapo_reward("Answer: \\text{}", "$") == -1.0
