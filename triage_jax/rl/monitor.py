"""Early-warning monitor: graded alarms from each step's mismatch diagnostics (docs/rl_math.md#diagnostics).

The paper's precursors of an NVFP4 collapse, watched over a sliding window of the last `window` steps:

- `rho_asym`: the A-d- mass outgrowing the A+d+ mass, read from the metric `rho_metric` names: by default
  `rho_asym_excess`, rho_asym over its permutation null (the advantages shuffled across the batch: 1 = what the
  batch's token counts give by themselves; docs/rl_math.md#nulls); `rho_asym` (raw) or `rho_asym_direction` (the
  length-free odds ratio) on request. Level 1: window mean above `rho_level1` while rising (the least-squares
  rise across the window above `rho_rise`); level 2: window mean above `rho_level2`.
- `tail_persistence`: tail-dense segments followed by tail-dense segments k x more often than their null, read
  from `persistence_metric` (default `tail_persistence_excess`: over each response's segments shuffled; raw
  `tail_persistence` is over the chance rate). Level 1: window mean above `persistence_level1`; level 2: above
  `persistence_level2`.
- `delta_q05`: the lower tail of delta falling below its early-run level (the median of the first `window`
  finite values). Level 1: the window mean fell by `q05_level1` x max(|baseline|, `q05_floor`) and is still
  falling; level 2: fell by `q05_level2` x that.

A window raises nothing until it holds `min_points` finite values, so NaN steps (an exact-mode run has no
A+d+ mass and no tail) never alarm. The core is pure: `update(state, metrics, cfg) -> (state, alarms)`;
`replay` runs it over a logged history and `first_alarms` returns the first step of each alarm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

ALARMS = ("rho_asym", "tail_persistence", "delta_q05")
RHO_METRICS = ("rho_asym_excess", "rho_asym", "rho_asym_direction")
PERSISTENCE_METRICS = ("tail_persistence_excess", "tail_persistence")
METRIC_PREFIX = "mismatch/"  # the trainer logs the diagnostics under this prefix
ACTIONS = ("none", "enable_correction")


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """Window and thresholds (`config.monitor.*` without `enabled` / `action` / `correction` / `action_level`)."""

    window: int = 10
    min_points: int = 5
    rho_level1: float = 1.2
    rho_level2: float = 1.5
    rho_rise: float = 0.05
    persistence_level1: float = 2.0
    persistence_level2: float = 3.0
    q05_level1: float = 1.0
    q05_level2: float = 3.0
    q05_floor: float = 0.01
    rho_metric: str = "rho_asym_excess"
    persistence_metric: str = "tail_persistence_excess"

    def __post_init__(self):
        for name, allowed in (("rho_metric", RHO_METRICS), ("persistence_metric", PERSISTENCE_METRICS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected one of {allowed}")
        if not (isinstance(self.window, int) and self.window >= 2):
            raise ValueError(f"window must be an int >= 2, got {self.window!r}")
        if not (isinstance(self.min_points, int) and 2 <= self.min_points <= self.window):
            raise ValueError(f"min_points must be an int in [2, window={self.window}], got {self.min_points!r}")
        for low, high in (("rho_level1", "rho_level2"), ("persistence_level1", "persistence_level2"),
                          ("q05_level1", "q05_level2")):
            lo, hi = getattr(self, low), getattr(self, high)
            if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
                raise ValueError(f"{low}={lo} and {high}={hi} must be finite with 0 < {low} <= {high}")
        for name in ("rho_rise", "q05_floor"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")


# Settings saved by runs from before the nulls existed have no metric keys: those runs watched the raw metrics.
SAVED_BEFORE_NULLS = {"rho_metric": "rho_asym", "persistence_metric": "tail_persistence"}


def monitor_config(settings: Mapping) -> MonitorConfig:
    """A MonitorConfig from `config.monitor` (its run keys enabled / action / action_level / correction set
    aside); a missing threshold takes its default, a wrong key raises naming it. Missing metric keys mean a run's
    settings saved before the nulls existed (SAVED_BEFORE_NULLS: the raw metrics it watched), so a replayed old
    study keeps its alarms; the config written today always holds them."""
    run_keys = {"enabled", "action", "action_level", "correction"}
    return MonitorConfig(**{**SAVED_BEFORE_NULLS, **{k: v for k, v in settings.items() if k not in run_keys}})


@dataclasses.dataclass(frozen=True)
class MonitorState:
    """The last `window` steps' watched values (step, rho_asym, tail_persistence, delta_q05), the early
    delta_q05 values that make its baseline, and the number of steps seen."""

    recent: tuple[tuple[float, float, float, float], ...] = ()
    q05_early: tuple[float, ...] = ()
    count: int = 0


def watched(metrics: Mapping[str, float], name: str) -> float:
    """`mismatch/<name>` (the trainer's key) or `<name>` from a step's metrics; NaN when absent."""
    v = metrics.get(METRIC_PREFIX + name, metrics.get(name, float("nan")))
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _finite(steps: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(ys)
    return steps[keep], ys[keep]


def _rise(steps: np.ndarray, ys: np.ndarray, window: int) -> float:
    """Least-squares slope of ys over steps, times the window's span: the fitted change across the window."""
    x = steps - steps.mean()
    denom = float(np.sum(x * x))
    return float(np.sum(x * (ys - ys.mean())) / denom) * (window - 1) if denom > 0 else 0.0


def _levels(state: MonitorState, cfg: MonitorConfig) -> dict[str, int]:
    rows = np.asarray(state.recent, dtype=np.float64).reshape(-1, 4)
    steps = rows[:, 0]
    out = dict.fromkeys(ALARMS, 0)

    s, rho = _finite(steps, rows[:, 1])
    if rho.size >= cfg.min_points:
        mean = float(rho.mean())
        if mean > cfg.rho_level2:
            out["rho_asym"] = 2
        elif mean > cfg.rho_level1 and _rise(s, rho, cfg.window) > cfg.rho_rise:
            out["rho_asym"] = 1

    _, pers = _finite(steps, rows[:, 2])
    if pers.size >= cfg.min_points:
        mean = float(pers.mean())
        out["tail_persistence"] = 2 if mean > cfg.persistence_level2 else int(mean > cfg.persistence_level1)

    s, q05 = _finite(steps, rows[:, 3])
    if q05.size >= cfg.min_points and len(state.q05_early) >= cfg.window:
        baseline = float(np.median(state.q05_early))
        fall = baseline - float(q05.mean())
        scale = max(abs(baseline), cfg.q05_floor)
        if fall > cfg.q05_level2 * scale:
            out["delta_q05"] = 2
        elif fall > cfg.q05_level1 * scale and _rise(s, q05, cfg.window) < 0:
            out["delta_q05"] = 1
    return out


def update(state: MonitorState, metrics: Mapping[str, float], cfg: MonitorConfig,
           step: int | None = None) -> tuple[MonitorState, dict[str, float]]:
    """Add one step's diagnostics (`step`, else metrics["step"], else the count of steps seen); returns the new
    state and the alarms {"alarm/<name>": level 0/1/2 for each of ALARMS, "alarm/level": their max}."""
    if step is None:
        step = metrics.get("step", state.count)
    values = tuple(watched(metrics, name) for name in (cfg.rho_metric, cfg.persistence_metric, "delta_q05"))
    recent = (state.recent + ((float(step),) + values,))[-cfg.window:]
    q05 = values[2]
    early = state.q05_early
    if len(early) < cfg.window and math.isfinite(q05):
        early = early + (q05,)
    new = MonitorState(recent=recent, q05_early=early, count=state.count + 1)
    levels = _levels(new, cfg)
    alarms = {f"alarm/{k}": float(v) for k, v in levels.items()}
    alarms["alarm/level"] = float(max(levels.values()))
    return new, alarms


def replay(history: Sequence[Mapping[str, float]], cfg: MonitorConfig,
           state: MonitorState = MonitorState()) -> tuple[MonitorState, list[dict[str, float]]]:
    """`update` over a logged history (the trainer's per-step dicts, summary or TensorBoard rows): the final
    state and each step's alarms."""
    out = []
    for metrics in history:
        state, alarms = update(state, metrics, cfg)
        out.append(alarms)
    return state, out


def first_alarms(history: Sequence[Mapping[str, float]], cfg: MonitorConfig, level: int = 1) -> dict[str, int | None]:
    """The first step at which each alarm (and "any" of them) reached `level`, or None when it never did."""
    if level not in (1, 2):
        raise ValueError(f"alarm level must be 1 or 2, got {level}")
    first: dict[str, int | None] = dict.fromkeys(ALARMS + ("any",))
    state = MonitorState()
    for i, metrics in enumerate(history):
        state, alarms = update(state, metrics, cfg)
        step = int(metrics.get("step", i))
        for name in ALARMS:
            if first[name] is None and alarms[f"alarm/{name}"] >= level:
                first[name] = step
        if first["any"] is None and alarms["alarm/level"] >= level:
            first["any"] = step
    return first


ACCURACY_KEY = "reward/accuracy"  # the trainer's rollout accuracy (every drawn response)


def collapsed(history: Sequence[Mapping[str, float]], *, patience: int = 20, drop: float = 0.5,
              min_peak: float = 0.05, q05_bound: float = -10.0, q05_patience: int = 1
              ) -> tuple[bool, int | None]:
    """The collapse rule of the organism studies: (collapsed, the step it began) over a logged history.

    A run has collapsed when its rollout accuracy (`reward/accuracy`) stays below `drop` x its running peak
    (the max so far, counted once it reaches `min_peak`) for `patience` consecutive steps, or when `delta_q05`
    (`mismatch/delta_q05`) stays below `q05_bound` for `q05_patience` consecutive steps (the paper's collapsed
    runs end with delta_q05 of -10 to -43). The step returned is the first step of the run of steps that
    confirmed it (the onset), for the criterion confirmed first; (False, None) when neither is. A step whose
    value is missing or not finite is skipped by that criterion (it neither counts nor breaks a run). Steps are
    `metrics["step"]`, else the row index.
    """
    if not (isinstance(patience, int) and patience >= 1 and isinstance(q05_patience, int) and q05_patience >= 1):
        raise ValueError(f"patience and q05_patience must be ints >= 1, got {patience!r}, {q05_patience!r}")
    if not 0 < drop < 1:
        raise ValueError(f"drop must be in (0, 1), got {drop}")
    peak = -math.inf
    acc_run: list[int] = []
    q05_run: list[int] = []
    for i, metrics in enumerate(history):
        step = int(metrics.get("step", i))
        try:
            acc = float(metrics.get(ACCURACY_KEY, float("nan")))
        except (TypeError, ValueError):
            acc = float("nan")
        if math.isfinite(acc):
            peak = max(peak, acc)
            if peak >= min_peak and acc < drop * peak:
                acc_run.append(step)
            else:
                acc_run = []
            if len(acc_run) >= patience:
                return True, acc_run[0]
        q05 = watched(metrics, "delta_q05")
        if math.isfinite(q05):
            q05_run = q05_run + [step] if q05 < q05_bound else []
            if len(q05_run) >= q05_patience:
                return True, q05_run[0]
    return False, None
