"""A run's raw per-token mismatch on disk (`train.save_deltas`) and the TRIAGE thresholds read off it.

A run logs only delta's quantiles; `propose_thresholds` (docs/rl_math.md#thresholds) needs the tokens and their
positions, since TRIAGE's statistics are per 64-token segment. A pilot run with `train.save_deltas=k` writes every
k-th step's delta [N, R], response mask [N, R] and advantages [N] to run_dir/deltas/step_NNNNNN.npz (step = the
history's 0-based `step`); `read` pools them and `propose` turns the pool into a TriageConfig.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import numpy as np

from triage_jax.rl.triage import TriageConfig, propose_thresholds

SUBDIR = "deltas"
_NAME = re.compile(r"step_(\d{6,})\.npz$")


def path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, SUBDIR, f"step_{step:06d}.npz")


def write(run_dir: str, step: int, delta_nr, mask_nr, adv_n) -> str:
    """One step's token deltas (float32 [N, R], 0 off the mask), mask and advantages; written atomically."""
    delta_nr, mask_nr, adv_n = (np.asarray(x, np.float32) for x in (delta_nr, mask_nr, adv_n))
    if delta_nr.ndim != 2 or mask_nr.shape != delta_nr.shape or adv_n.shape != delta_nr.shape[:1]:
        raise ValueError(f"deltas.write: need delta [N,R], mask [N,R], adv [N]; got {delta_nr.shape}, "
                         f"{mask_nr.shape}, {adv_n.shape}")
    out = path(run_dir, step)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp.npz"
    np.savez_compressed(tmp, delta=np.where(mask_nr > 0, delta_nr, 0.0), mask=mask_nr, adv=adv_n)
    os.replace(tmp, out)
    return out


def saved_steps(run_dir: str) -> list[int]:
    found = (_NAME.search(os.path.basename(p)) for p in glob.glob(os.path.join(run_dir, SUBDIR, "step_*.npz")))
    return sorted(int(m.group(1)) for m in found if m)


@dataclasses.dataclass(frozen=True)
class Pool:
    """Rows of every read step, response positions right-padded to the longest (mask 0 there)."""

    delta: np.ndarray  # float32 [rows, R]
    mask: np.ndarray  # float32 [rows, R]
    adv: np.ndarray  # float32 [rows]
    steps: tuple[int, ...]


def read(run_dir: str, steps: range | list[int] | None = None) -> Pool:
    """The saved deltas of `steps` (default: all saved), pooled. Names the folder when nothing is there."""
    have = saved_steps(run_dir)
    want = have if steps is None else sorted(set(steps) & set(have))
    if not want:
        hint = ("no deltas were saved: run the pilot with train.save_deltas=1" if not have
                else f"saved steps are {have[0]}..{have[-1]}, none in the requested {steps}")
        raise FileNotFoundError(f"{os.path.join(run_dir, SUBDIR)}: {hint}")
    parts = []
    for s in want:
        with np.load(path(run_dir, s)) as z:
            parts.append((z["delta"], z["mask"], z["adv"]))
    width = max(d.shape[1] for d, _, _ in parts)

    def pad(x):
        return np.pad(x, ((0, 0), (0, width - x.shape[1])))

    return Pool(delta=np.concatenate([pad(d) for d, _, _ in parts]), mask=np.concatenate([pad(m) for _, m, _ in parts]),
                adv=np.concatenate([a for _, _, a in parts]), steps=tuple(want))


def propose(run_dir: str, base: TriageConfig, steps=None, **kwargs) -> tuple[TriageConfig, Pool]:
    """TRIAGE thresholds from a pilot run's saved deltas (`propose_thresholds` on the pooled tokens); the
    segment length, gate floor and repair settings stay `base`'s (the run's own rl.triage)."""
    pool = read(run_dir, steps)
    return propose_thresholds(pool.delta, pool.mask, base, **kwargs), pool


THRESHOLD_KEYS = ("tau_tail", "f_lo", "f_hi", "g_lo", "g_hi")


def overrides(cfg: TriageConfig) -> dict[str, float]:
    """The proposed thresholds as config overrides (`rl.triage.<key>`)."""
    return {f"rl.triage.{k}": float(getattr(cfg, k)) for k in THRESHOLD_KEYS}
