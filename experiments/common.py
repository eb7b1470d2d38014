"""Shared helpers of the experiment scripts and notebooks: configs, the cached warm-up, run logs, tables, plots.

Nothing here trains; the studies (mismatch_matrix.py, stability.py) and the notebooks import these so that
they read configs, warm-up caches and TensorBoard logs the same way. Everything they build comes from the library
(`triage_jax.build`, `triage_jax.probe`, `triage_jax.evaluation`, `triage_jax.rl`), never from the CLIs in tools/.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import struct
import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from triage_jax.config import load_config  # noqa: F401  (re-exported: the experiments read configs here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = os.path.join(ROOT, "experiments", "figures")


# ------------------------------------------------------------------------------------------------ configs

def set_values(c, overrides: Mapping[str, Any]):
    """Set dotted keys ("rl.triage.lambda_rep") on a locked ConfigDict; an unknown key raises naming it."""
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            if p not in node:
                raise KeyError(f"config key {key!r}: no section {p!r}")
            node = node[p]
        if leaf not in node:
            raise KeyError(f"config key {key!r} does not exist")
        node[leaf] = value
    return c


def parse_overrides(parser, items) -> dict:
    """`--set KEY=VALUE` items -> {KEY: parsed value}; a malformed item is a parser error naming it."""
    parsed = {}
    for item in items:
        if "=" not in item:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        parsed[k] = parse_value(v)
    return parsed


def parse_value(text: str):
    """A KEY=VALUE override's value: a Python literal when it parses as one ("3e-4", "(1, 3)"), else the string."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def absolute_paths(c):
    """Make run_dir and warmup.cache_dir absolute (relative to the repo root), so any working directory works."""
    if not os.path.isabs(c.run_dir):
        c.run_dir = os.path.join(ROOT, c.run_dir)
    if not os.path.isabs(c.warmup.cache_dir):
        c.warmup.cache_dir = os.path.join(ROOT, c.warmup.cache_dir)
    return c


@contextlib.contextmanager
def compile_cache(path: str):
    """JAX's persistent compilation cache in `path` while the block runs (no-op for ''): runs that differ only in
    their seed (or a rerun of a study) load the compiled learner and sampler from disk instead of recompiling them.

    The previous settings come back on exit, so a study called in-process (the tests) does not leave every later
    compilation of that process writing to its cache folder.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    if not path:
        yield
        return
    os.makedirs(path, exist_ok=True)
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    before = {k: getattr(jax.config, k) for k in keys}
    for k, v in zip(keys, (path, 0.0, 0)):
        jax.config.update(k, v)
    cc.reset_cache()  # JAX opens its cache once per process: forget any folder opened before
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        cc.reset_cache()


# ------------------------------------------------------------------------------------------------ warm-up

def warm_model(c, *, dtype: str | None = None, progress: bool = False):
    """(model, tokenizer, model config, cache folder) of the cached warm-up of config `c` (trained if absent).

    `dtype` reloads the cached checkpoint in another compute (and parameter) dtype, e.g. "bfloat16".
    """
    from triage_jax import build, models
    from triage_jax.warmup import cache_path, warm_start

    tok, source = build.tokenizer(c), build.source(c)
    mc = build.model_config(c, tok.vocab_size)
    model = warm_start(c, mc, tok, source, progress=progress)
    path = cache_path(c, mc, tok, source)
    if dtype is not None and dtype != c.model.dtype:
        model = models.from_pretrained(path, dtype=dtype)
    return model, tok, mc, path


def share_warmup(c, base_seed: int) -> str | None:
    """Point the warm-up cache of `c` (whose seed may differ) at the one trained with `base_seed`.

    The warm-up cache key includes the seed, so every RL seed would otherwise pay for its own supervised warm-up.
    The studies vary the RL seed from one shared starting policy instead (as one would from a fixed pretrained
    checkpoint). Returns the linked folder, or None when `c` already uses `base_seed` or has its own cache.
    """
    from triage_jax import build
    from triage_jax.warmup import cache_path

    if c.seed == base_seed:
        return None
    tok, source = build.tokenizer(c), build.source(c)
    mc = build.model_config(c, tok.vocab_size)
    target = cache_path(c, mc, tok, source)
    if os.path.exists(os.path.join(target, "config.json")):
        return None
    base = c.copy_and_resolve_references()
    base.seed = base_seed
    shared = cache_path(base, mc, tok, source)
    if not os.path.exists(os.path.join(shared, "config.json")):
        raise FileNotFoundError(f"no warm-up cache for seed {base_seed} at {shared}; warm it up first")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(target):
        os.remove(target)
    os.symlink(os.path.abspath(shared), target)
    return target


# ------------------------------------------------------------------------------------------------ sampling, delta

def held_out_prompts(c, tok, num_prompts: int):
    """(token-id prompts, ground truths) of the run's held-out synthetic problems (`build.held_out`, as tools/eval)."""
    from triage_jax import build, probe

    return probe.encode_examples(tok, build.held_out(c, num_prompts))


def sample(model, tok, prompts, truths, *, sampler: str, kv: str, group_size: int, max_new_tokens: int,
           temperature: float, seed: int, max_cache_len: int | None = None):
    """(SampleOutput, group advantages [N], scored) of `group_size` responses per prompt under a sampler preset."""
    from triage_jax import probe
    from triage_jax.sampler import SamplingConfig

    rows = [p for p in prompts for _ in range(group_size)]
    scfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=tuple(tok.eos_ids))
    out = probe.sample_responses(model, rows, scfg, sampler=sampler, kv=kv, seed=seed, pad_id=tok.pad_id,
                                 max_cache_len=max_cache_len)
    adv, scored = probe.advantages(out.tokens, out.mask, list(truths), tok, group_size)
    return out, adv, scored


def learner_logprobs(model, out, learner: str, *, temperature: float):
    """Learner log-probs [N, T] of the sampled tokens, recomputed in one teacher-forced pass under `learner`."""
    from triage_jax import probe

    return probe.recompute_logprobs(model, out, learner, temperature=temperature, vocab_chunk=model.cfg.vocab_size)


def delta_of(learner_logp, out):
    """delta = learner - sampler log-prob on `out`'s real response tokens, 0 on padding ([N, T]): rl.delta's."""
    from triage_jax.rl.delta import token_delta

    return token_delta(learner_logp, out.logprobs, out.mask)


def config_from_json(path: str):
    """A run's config (written by the studies as config.json) on top of base_config(): lists become tuples where
    the schema has tuples, so the locked ConfigDict accepts them. Keys the current schema no longer has (a run
    made by an older version) are skipped with a warning naming them."""
    from triage_jax.config import base_config

    with open(path) as f:
        saved = json.load(f)
    c = base_config()
    dropped = []

    def walk(node, d, prefix):
        for k, v in d.items():
            if k not in node:
                dropped.append(prefix + k)
            elif isinstance(v, dict):
                walk(node[k], v, prefix + k + ".")
            else:
                node[k] = tuple(v) if isinstance(node[k], tuple) else v

    walk(c, saved, "")
    if dropped:
        warnings.warn(f"{path}: keys not in the current config schema, ignored: {dropped}")
    return c


# ------------------------------------------------------------------------------------------------ run logs

def _records(path: str) -> Iterable[bytes]:
    """Payloads of a TFRecord file (u64 length, u32 crc, data, u32 crc); a truncated tail record is skipped."""
    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if len(header) < 12:
                return
            (n,) = struct.unpack("<Q", header[:8])
            data = f.read(n)
            if len(data) < n or len(f.read(4)) < 4:
                return
            yield data


def read_scalars(tb_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{tag: (steps, values)} of every scalar in the tensorboardX event files under `tb_dir`, sorted by step.

    A step written twice (a resumed run) keeps its last value.
    """
    from tensorboardX.proto import event_pb2

    files = sorted(glob.glob(os.path.join(tb_dir, "**", "events.out.tfevents.*"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no tensorboard event files under {tb_dir}")
    acc: dict[str, dict[int, float]] = {}
    for path in files:
        for rec in _records(path):
            ev = event_pb2.Event.FromString(rec)
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    acc.setdefault(v.tag, {})[int(ev.step)] = float(v.simple_value)
    out = {}
    for tag, by_step in acc.items():
        steps = np.array(sorted(by_step), np.int64)
        out[tag] = (steps, np.array([by_step[s] for s in steps], np.float64))
    return out


def aligned(scalars: dict, tag: str, steps: np.ndarray) -> np.ndarray:
    """Values of `tag` at `steps`, NaN where it was not logged (the trainer skips non-finite values, e.g. the
    |A|-weighted shares of a step whose advantages are all zero)."""
    out = np.full(len(steps), np.nan)
    if tag in scalars:
        pos = {int(s): i for i, s in enumerate(steps)}
        for s, v in zip(*scalars[tag]):
            if int(s) in pos:
                out[pos[int(s)]] = v
    return out


def read_history(run_dir: str) -> list[dict[str, float]]:
    """The per-step metric dicts a study saved beside a run (history.json)."""
    path = os.path.join(run_dir, "history.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist (was the run made by experiments/stability.py?)")
    with open(path) as f:
        return [{k: (math.nan if v is None else v) for k, v in row.items()} for row in json.load(f)]


def write_json(path: str, obj) -> None:
    """JSON with NaN/inf written as null (strict JSON readers reject NaN)."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (np.floating, np.integer)):
            return clean(x.item())
        return x

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean(obj), f, indent=1)


# ------------------------------------------------------------------------------------------------ tables, plots

def fmt(v, digits: int = 4) -> str:
    """A table cell: fixed decimals for floats, '-' for missing/NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 4) -> str:
    """A GitHub markdown table."""
    cells = [[fmt(v, digits) for v in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def use_agg():
    """matplotlib with the non-interactive Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rolling_mean(values_ks: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` steps of each row, skipping NaNs (a step whose whole window is NaN stays
    NaN); window 1 returns the values unchanged. Per-step GRPO metrics are noisy at small batch sizes."""
    values_ks = np.asarray(values_ks, np.float64)
    if window <= 1:
        return values_ks
    finite = np.isfinite(values_ks)
    csum = np.cumsum(np.where(finite, values_ks, 0.0), axis=-1)
    ccount = np.cumsum(finite, axis=-1)
    pad = lambda a: np.concatenate([np.zeros(a.shape[:-1] + (window,)), a], axis=-1)  # noqa: E731
    total = pad(csum)[..., window:] - pad(csum)[..., :-window]
    count = pad(ccount)[..., window:] - pad(ccount)[..., :-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


def band(ax, steps: np.ndarray, values_ks: np.ndarray, label: str, color=None):
    """Mean over seeds (rows) against step, shaded between the per-step min and max; NaNs are skipped."""
    values_ks = np.asarray(values_ks, np.float64)
    with warnings.catch_warnings():  # an all-NaN step (metric undefined in every seed) stays NaN: a gap
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(values_ks, axis=0)
        lo, hi = np.nanmin(values_ks, axis=0), np.nanmax(values_ks, axis=0)
    (line,) = ax.plot(steps, mean, label=label, color=color, lw=1.5)
    ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
    return line


def save_figure(fig, path: str, dpi: int = 90) -> str:
    """Write a PNG (creating its folder) and close the figure; returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
