"""Early-warning monitor: alarms fire at the hand-computed step on synthetic histories, never on flat or
exact-mode ones, and a replayed history resumes the same state."""

import math

import numpy as np
import pytest

from triage_jax.rl.monitor import ALARMS, MonitorConfig, MonitorState, first_alarms, monitor_config, replay, update

# window 10, min_points 5, rho 1.2 / 1.5, persistence 2 / 3, q05 1x / 3x, floor 0.01; on the raw metrics, which the
# synthetic histories below carry (the default reads their null-normalized `_excess` forms: test_default_reads_...)
CFG = MonitorConfig(rho_metric="rho_asym", persistence_metric="tail_persistence")


def history(n, **series):
    """n per-step dicts with the trainer's keys; each series is a function of the step index."""
    return [{"step": t, **{f"mismatch/{k}": float(f(t)) for k, f in series.items()}} for t in range(n)]


def test_rising_rho_asym_alarms_at_the_expected_steps():
    # rho_t = 1 + 0.045 t. Before the window fills (t < 9) its mean is 1 + 0.0225 t <= 1.18; then the window of
    # steps t-9..t has mean 1 + 0.045 (t - 4.5) and rises 0.405 across it.
    # Level 1 (mean > 1.2, rising): t > 8.94 -> step 9. Level 2 (mean > 1.5): t > 15.6 -> step 16.
    h = history(40, rho_asym=lambda t: 1.0 + 0.045 * t)
    assert first_alarms(h, CFG, level=1) == {"rho_asym": 9, "tail_persistence": None, "delta_q05": None, "any": 9}
    assert first_alarms(h, CFG, level=2)["rho_asym"] == 16


def test_high_but_falling_rho_asym_is_only_watched_once_it_exceeds_level2():
    # Falling from 1.45: never level 1 (not rising), never level 2 (mean below 1.5).
    h = history(40, rho_asym=lambda t: 1.45 - 0.01 * t)
    assert first_alarms(h, CFG)["rho_asym"] is None


def test_tail_persistence_above_k_times_chance():
    # 1.0 (chance) for steps 0-9, then 4.0: the window mean at t >= 9 is 1 + 0.3 (t - 9).
    # Level 1 (> 2): t - 9 > 3.33 -> step 13. Level 2 (> 3): t - 9 > 6.67 -> step 16.
    h = history(30, tail_persistence=lambda t: 1.0 if t < 10 else 4.0)
    assert first_alarms(h, CFG, level=1)["tail_persistence"] == 13
    assert first_alarms(h, CFG, level=2)["tail_persistence"] == 16


def test_falling_delta_q05_alarms_against_its_early_baseline():
    # -0.1 for steps 0-9 (baseline -0.1), then -0.1 - 0.05 (t - 9). For t in 10..18 the window mean is
    # -0.1 - 0.05 (t-9)(t-8) / 20; level 1 needs a fall > 1 x 0.1: (t-9)(t-8) > 40 -> step 15 (t=14: 30).
    # Level 2 needs a fall > 0.3 with the window fully falling (t >= 18): 0.05 (t - 13.5) > 0.3 -> step 20.
    h = history(40, delta_q05=lambda t: -0.1 if t < 10 else -0.1 - 0.05 * (t - 9))
    assert first_alarms(h, CFG, level=1)["delta_q05"] == 15
    assert first_alarms(h, CFG, level=2)["delta_q05"] == 20


def test_flat_bf16_like_history_raises_nothing():
    rng = np.random.default_rng(0)
    noise = rng.normal(size=(300, 3))
    h = [{"step": t, "mismatch/rho_asym": 1.0 + 0.05 * noise[t, 0],
          "mismatch/tail_persistence": max(0.0, 1.0 + 0.3 * noise[t, 1]),
          "mismatch/delta_q05": -0.002 + 0.0005 * noise[t, 2]} for t in range(300)]
    _, alarms = replay(h, CFG)
    assert all(a["alarm/level"] == 0.0 for a in alarms)
    assert first_alarms(h, CFG) == dict.fromkeys(ALARMS + ("any",))


def test_exact_mode_nans_never_alarm():
    # delta == 0 exactly: no A+d+ mass (rho_asym NaN), no tail (persistence NaN), q05 = 0.
    h = history(50, rho_asym=lambda t: math.nan, tail_persistence=lambda t: math.nan, delta_q05=lambda t: 0.0)
    assert first_alarms(h, CFG)["any"] is None


def test_too_few_finite_points_in_the_window_stay_quiet():
    # rho is huge but finite only every third step: 3-4 finite values per 10-step window < min_points 5.
    h = history(40, rho_asym=lambda t: 5.0 if t % 3 == 0 else math.nan)
    assert first_alarms(h, CFG)["rho_asym"] is None
    assert first_alarms(h, MonitorConfig(min_points=3, rho_metric="rho_asym"))["rho_asym"] is not None


def test_replay_then_continue_equals_one_pass_and_keys_may_be_unprefixed():
    h = history(30, rho_asym=lambda t: 1.0 + 0.04 * t, delta_q05=lambda t: -0.05 - 0.01 * t)
    full, alarms_full = replay(h, CFG)
    state, _ = replay(h[:17], CFG)  # a resumed run rebuilds its state from the checkpointed history
    state, alarms_rest = replay(h[17:], CFG, state)
    assert repr(state) == repr(full) and alarms_rest == alarms_full[17:]  # repr: NaN == NaN
    bare = [{k.removeprefix("mismatch/"): v for k, v in m.items()} for m in h]
    assert replay(bare, CFG)[1] == alarms_full


def test_update_reports_every_alarm_and_their_max():
    state, alarms = update(MonitorState(), {"mismatch/rho_asym": 1.0}, CFG)
    assert set(alarms) == {f"alarm/{k}" for k in ALARMS} | {"alarm/level"}
    assert state.count == 1 and state.recent[0][0] == 0.0


@pytest.mark.parametrize("settings,match", [
    ({"window": 1}, "window"),
    ({"min_points": 20}, "min_points"),
    ({"rho_level1": 2.0, "rho_level2": 1.5}, "rho_level1"),
    ({"q05_floor": -1.0}, "q05_floor"),
    ({"windows": 3}, "windows"),
    ({"rho_metric": "rho"}, "rho_metric"),
    ({"persistence_metric": "tail_freq"}, "persistence_metric"),
])
def test_bad_settings_fail_naming_them(settings, match):
    with pytest.raises((ValueError, TypeError), match=match):
        monitor_config({"enabled": True, "action": "none", **settings})


def test_collapse_rule_accuracy_below_half_its_peak_for_20_steps():
    from triage_jax.rl.monitor import collapsed

    rise = [{"step": s, "reward/accuracy": 0.1 + 0.02 * s} for s in range(10)]  # peak 0.28 at step 9
    dip = [{"step": 10 + s, "reward/accuracy": 0.1} for s in range(19)]  # below 0.14 for 19 steps only
    assert collapsed(rise + dip) == (False, None)
    back = [{"step": 29, "reward/accuracy": 0.2}]  # the run breaks
    fall = [{"step": 30 + s, "reward/accuracy": 0.05} for s in range(20)]
    assert collapsed(rise + dip + back + fall) == (True, 30)
    assert collapsed(rise + dip + [{"step": 29, "reward/accuracy": 0.0}]) == (True, 10)
    # NaN / missing steps are skipped; a run that never reached min_peak never collapses
    gappy = rise + [{"step": 10 + s, "reward/accuracy": 0.1 if s % 2 else float("nan")} for s in range(40)]
    assert collapsed(gappy) == (True, 11)
    assert collapsed([{"reward/accuracy": 0.04}] + [{"reward/accuracy": 0.0}] * 30) == (False, None)
    assert collapsed([{"reward/accuracy": 0.5}] + [{"reward/accuracy": 0.2}] * 30, patience=5) == (True, 1)


def test_collapse_rule_delta_q05_bound():
    from triage_jax.rl.monitor import collapsed

    rows = [{"step": s, "reward/accuracy": 0.4, "mismatch/delta_q05": -0.5} for s in range(5)]
    rows += [{"step": 5, "reward/accuracy": 0.4, "mismatch/delta_q05": -12.0}]
    assert collapsed(rows) == (True, 5)
    assert collapsed(rows, q05_patience=2) == (False, None)
    assert collapsed(rows, q05_bound=-20.0) == (False, None)
    assert collapsed([{"reward/accuracy": 0.4, "delta_q05": -11.0}]) == (True, 0)  # the bare name works too
    with pytest.raises(ValueError, match="patience"):
        collapsed(rows, patience=0)
    with pytest.raises(ValueError, match="drop"):
        collapsed(rows, drop=1.5)


def test_default_reads_the_null_normalized_statistics():
    """By default the alarms read rho_asym / its permutation null and tail persistence / its shuffle null: a raw
    rho_asym that rises only as much as its null does (lengths, the balance of d- and d+) raises nothing."""
    default = MonitorConfig()
    assert (default.rho_metric, default.persistence_metric) == ("rho_asym_excess", "tail_persistence_excess")
    confounded = history(40, rho_asym=lambda t: 1.0 + 0.045 * t, rho_asym_excess=lambda t: 1.0,
                         tail_persistence=lambda t: 4.0, tail_persistence_excess=lambda t: 1.0)
    assert first_alarms(confounded, default)["any"] is None
    assert first_alarms(confounded, CFG)["rho_asym"] == 9  # the raw metrics alarm on the same history
    real = history(40, rho_asym_excess=lambda t: 1.0 + 0.045 * t)
    assert first_alarms(real, default)["rho_asym"] == 9
    # A run's saved settings from before the nulls (no metric keys) replay on the raw metrics it watched; the config
    # written today names the null-normalized ones.
    from triage_jax.config import base_config

    assert monitor_config({"enabled": True}).rho_metric == "rho_asym"
    assert monitor_config(base_config().monitor.to_dict()) == default
    direction = history(40, rho_asym_direction=lambda t: 1.0 + 0.045 * t)
    assert first_alarms(direction, MonitorConfig(rho_metric="rho_asym_direction"))["rho_asym"] == 9
