"""The miniTE precision table at CPU scale: learner/sampler mismatch mean |delta| for each precision setting.

    python experiments/mismatch_matrix.py [--models tiny,tiny_moe] [--dtypes bfloat16,float32]
        [--num_prompts 64] [--group_size 4] [--out experiments/results] [--figure experiments/figures/...png]
        [--settings "MXFP4 / MXFP4,W4A4 (MXFP4 act.)"] [--decompose w4a4]

For each warmed-up tiny model (configs/tiny.py, configs/tiny_moe.py; the cached supervised warm-up) and compute
dtype, held-out synthetic prompts are sampled once per sampler setting; the learner recomputes the log-probs of
those tokens under its precision, and delta = learner - sampler log-prob per response token (docs/rl_math.md#delta).
Prints a markdown table of mean |delta| beside the paper's miniTE values (each row naming the mismatch sources
it holds), checks the paper's orderings on the measured numbers, and draws a bar chart. Then the decomposition
(`probe.decomposition`, as `tools.mismatch --decompose`): exact mode's zero, and one source added at a time.

"BF16" here means no quantization in the given compute dtype. With --dtypes float32 the BF16/BF16 pair is the
same float32 network evaluated two ways (KV-cache decode vs one teacher-forced pass) and its mismatch is ~1e-6;
with bfloat16 (the default, as in the paper's BF16 runs) both sides round in bf16 along different reduction
orders, which is the floor a real BF16 sampler/learner pair has.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

# Paper values (docs/rl_math.md#paper-reference-values): reference
# data to compare against, not results of this code.
PAPER = {
    "BF16 / BF16": {"tiny": 0.0110, "tiny_moe": 0.0172},
    "NVFP4 / NVFP4": {"tiny": 0.1142, "tiny_moe": 0.0668},
    "NVFP4 / BF16": {"tiny": 0.1376, "tiny_moe": 0.0621},
    "BF16 / NVFP4": {"tiny": 0.1690, "tiny_moe": 0.0747},
    "W4A16": {"tiny": 0.0139, "tiny_moe": 0.0166},
    "W4A8 (MXFP8 act.)": {"tiny": 0.0363, "tiny_moe": 0.0227},
    "W4A4 (NVFP4 act.)": {"tiny": 0.0903, "tiny_moe": 0.0445},
    "KV FP8 (W4A4 sampler)": {"tiny": 0.0721},
    "KV BF16 (W4A4 sampler)": {"tiny": 0.0583},
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row: learner precision preset, sampler precision preset, sampler KV-cache format."""

    label: str
    learner: str
    sampler: str
    kv: str = "bf16"
    measures: str = ""  # the mismatch sources the row holds, named as the decomposition table names them


# "NVFP4" on either side is the W4A4 preset (NVFP4 weights and activations; embeddings, LM head, router and norms
# stay high precision). The weight/activation rows quantize the sampler only, against a BF16 learner.
_PATHS = "default paths (reduction orders)"
SETTINGS = (
    Setting("BF16 / BF16", "bf16", "bf16", measures=_PATHS),
    Setting("NVFP4 / NVFP4", "w4a4", "w4a4", measures=f"learner act. scales per tensor + {_PATHS}"),
    Setting("NVFP4 / BF16", "w4a4", "bf16", measures=f"learner weights + act. (per tensor) + {_PATHS}"),
    Setting("BF16 / NVFP4", "bf16", "w4a4", measures=f"sampler weights + act. + {_PATHS}"),
    Setting("W4A16", "bf16", "w4a16", measures=f"sampler NVFP4 weights + {_PATHS}"),
    Setting("W4A8 (MXFP8 act.)", "bf16", "w4a8", measures=f"sampler weights + MXFP8 act. + {_PATHS}"),
    Setting("W4A4 (NVFP4 act.)", "bf16", "w4a4", measures=f"sampler weights + act. + {_PATHS}"),
    Setting("KV FP8 (W4A4 sampler)", "bf16", "w4a4", "fp8", measures="the W4A4 row + sampler FP8 KV cache"),
    Setting("KV BF16 (W4A4 sampler)", "bf16", "w4a4", "bf16", measures="the W4A4 row (the FP8 row's control)"),
    # MXFP4 (OCP MX: E2M1, one power-of-two E8M0 scale per 32 elements, no tensor scale; numerics.md "MXFP4"),
    # the gpt-oss format: not in the paper, a coarser 4-bit dial than NVFP4 next to its rows.
    Setting("MXFP4 / MXFP4", "w4a4_mx", "w4a4_mx", measures=f"{_PATHS} (MX scales are per token on both sides)"),
    Setting("W4A16 (MXFP4 weights)", "bf16", "w4a16_mx", measures=f"sampler MXFP4 weights + {_PATHS}"),
    Setting("W4A4 (MXFP4 act.)", "bf16", "w4a4_mx", measures=f"sampler MXFP4 weights + act. + {_PATHS}"),
)
LABELS = tuple(s.label for s in SETTINGS)

# The paper's qualitative claims, as strict orderings between rows: (name, chain of labels, models). A chain
# [a, b, c] claims value(a) < value(b) < value(c). Whether each holds is computed on the paper's numbers and on
# ours; a claim only counts for a model where the paper reports every row of it.
ORDERINGS = (
    ("matched BF16 has the smallest mismatch", "min", "BF16 / BF16"),
    ("weights-only < MXFP8 act. < NVFP4 act.", "chain", ("W4A16", "W4A8 (MXFP8 act.)", "W4A4 (NVFP4 act.)")),
    ("matched NVFP4 < NVFP4 learner / BF16 sampler", "chain", ("NVFP4 / NVFP4", "NVFP4 / BF16")),
    ("matched NVFP4 < BF16 learner / NVFP4 sampler", "chain", ("NVFP4 / NVFP4", "BF16 / NVFP4")),
    ("quantized learner < quantized sampler", "chain", ("NVFP4 / BF16", "BF16 / NVFP4")),
    ("FP8 KV cache adds mismatch", "chain", ("KV BF16 (W4A4 sampler)", "KV FP8 (W4A4 sampler)")),
    ("W4A4 sampler: MoE < dense", "models", "W4A4 (NVFP4 act.)"),
)


def claim_holds(kind: str, arg, values: dict[str, float]) -> bool | None:
    """Whether one ORDERINGS claim holds for {label: mean |delta|} of one model; None if a row is missing."""
    if kind == "min":
        if arg not in values or len(values) < 2:
            return None
        return all(values[arg] < v for k, v in values.items() if k != arg)
    if kind == "chain":
        if any(k not in values for k in arg):
            return None
        return all(values[a] < values[b] for a, b in zip(arg, arg[1:]))
    raise ValueError(f"unknown claim kind {kind!r}")


def check_orderings(ours: dict[str, dict[str, float]], paper: dict[str, dict[str, float]] = PAPER):
    """Rows (claim, model, holds in the paper, holds here) for every claim the paper's numbers decide.

    `ours` is {model: {label: mean |delta|}}; `paper` is {label: {model: value}} as PAPER.
    """
    paper_by_model: dict[str, dict[str, float]] = {}
    for label, per in paper.items():
        for m, v in per.items():
            paper_by_model.setdefault(m, {})[label] = v
    rows = []
    for name, kind, arg in ORDERINGS:
        if kind == "models":
            p = [paper.get(arg, {}).get(m) for m in ("tiny_moe", "tiny")]
            o = [ours.get(m, {}).get(arg) for m in ("tiny_moe", "tiny")]
            rows.append((name, "both", None if None in p else p[0] < p[1], None if None in o else o[0] < o[1]))
            continue
        for m in ours:
            pv = paper_by_model.get(m, {})
            sub = {k: v for k, v in ours[m].items() if k in pv}
            rows.append((name, m, claim_holds(kind, arg, pv), claim_holds(kind, arg, sub)))
    return [r for r in rows if r[2] is not None]


# ------------------------------------------------------------------------------------------------ measurement

def standard_error(delta, mask) -> float:
    """Standard error of mean |delta| over responses: the spread of per-response means / sqrt(responses).
    Tokens of one response are correlated, so responses (not tokens) are the independent samples."""
    import numpy as np

    d, m = np.abs(np.asarray(delta, np.float64)), np.asarray(mask, bool)
    n = m.sum(1)
    keep = n > 0
    if keep.sum() < 2:
        return float("nan")
    per = (d * m).sum(1)[keep] / n[keep]
    w = n[keep] / n[keep].sum()  # token-weighted, as the mean itself
    mean = (per * w).sum()
    return float(np.sqrt(((w * (per - mean)) ** 2).sum() * keep.sum() / (keep.sum() - 1)))


def claim_margin(kind: str, arg, values: dict[str, float], se: dict[str, float]) -> float | None:
    """Smallest |difference| / combined standard error over the pairs a claim compares (None if undecidable):
    below ~2 the measured order is within sampling noise."""
    if kind == "min":
        pairs = [(arg, k) for k in values if k != arg]
    elif kind == "chain":
        pairs = list(zip(arg, arg[1:]))
    else:
        raise ValueError(f"unknown claim kind {kind!r}")
    z = []
    for a, b in pairs:
        if a not in values or b not in values:
            return None
        err = math.hypot(se.get(a, math.nan), se.get(b, math.nan))
        if not math.isfinite(err):
            return None
        z.append(abs(values[a] - values[b]) / max(err, 1e-30))
    return min(z) if z else None


def measure_model(model, tok, prompts, truths, settings, *, group_size: int, max_new_tokens: int,
                  temperature: float, seed: int, max_cache_len: int) -> dict[str, dict[str, float]]:
    """{label: diagnostics} for each setting; responses are sampled once per (sampler, kv) and reused."""
    from triage_jax.probe import diagnostics

    samples, learner_logps, results = {}, {}, {}
    for s in settings:
        skey = (s.sampler, s.kv)
        if skey not in samples:
            t0 = time.perf_counter()
            out, adv, scored = common.sample(model, tok, prompts, truths, sampler=s.sampler, kv=s.kv,
                                             group_size=group_size, max_new_tokens=max_new_tokens,
                                             temperature=temperature, seed=seed, max_cache_len=max_cache_len)
            samples[skey] = (out, adv, scored, time.perf_counter() - t0)
        out, adv, scored, t_sample = samples[skey]
        lkey = (skey, s.learner)
        if lkey not in learner_logps:
            learner_logps[lkey] = common.learner_logprobs(model, out, s.learner, temperature=temperature)
        delta = common.delta_of(learner_logps[lkey], out)
        metrics = diagnostics(adv, delta, out.mask)
        metrics["se_abs_delta"] = standard_error(delta, out.mask)
        metrics.update(accuracy=float(scored.accuracy.mean()), response_tokens=int(out.mask.sum()),
                       sample_s=t_sample)
        results[s.label] = metrics
    return results


def measure_decomposition(model, tok, prompts, truths, precision: str, *, group_size: int, max_new_tokens: int,
                          temperature: float, seed: int, max_cache_len: int) -> list[dict]:
    """`probe.decomposition(precision)` on these prompts: one row per step, each adding one mismatch source to
    exact mode's zero (docs/numerics.md#exact-mode)."""
    from triage_jax import probe
    from triage_jax.sampler import SamplingConfig

    rows = [p for p in prompts for _ in range(group_size)]
    scfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, stop_ids=tuple(tok.eos_ids))
    out = []
    for step in probe.decomposition(precision):
        m = probe.measure_step(model, rows, scfg, step, truths=list(truths), tok=tok, group_size=group_size,
                               seed=seed, pad_id=tok.pad_id, temperature=temperature,
                               vocab_chunk=model.cfg.vocab_size, max_cache_len=max_cache_len)
        out.append({"step": step.name, **{k: m.get(k) for k in DECOMPOSE_KEYS}})
    return out


DECOMPOSE_KEYS = ("mean_abs_delta", "max_abs_delta", "delta_q05", "delta_q95", "rho_asym", "routing_flip_frac",
                  "response_tokens")


def run(args) -> dict:
    """Measure every setting for every model and dtype; returns {"results": {dtype: {model: {label: metrics}}}}."""
    results: dict[str, dict[str, dict]] = {}
    breakdown: dict[str, dict[str, list]] = {}
    timings = {}
    settings = [s for s in SETTINGS if s.label in args.settings]
    for model_name in args.models:
        c = common.absolute_paths(common.set_values(common.load_config(model_name), args.overrides))
        prompts = truths = None
        for dtype in args.dtypes:
            t0 = time.perf_counter()
            model, tok, mc, _ = common.warm_model(c, dtype=dtype)
            if prompts is None:
                prompts, truths = common.held_out_prompts(c, tok, args.num_prompts)
            res = measure_model(model, tok, prompts, truths, settings, group_size=args.group_size,
                                max_new_tokens=c.sampler.max_new_tokens, temperature=c.sampler.temperature,
                                seed=args.seed, max_cache_len=c.sampler.max_prompt_len + c.sampler.max_new_tokens)
            results.setdefault(dtype, {})[model_name] = res
            if args.decompose:
                breakdown.setdefault(dtype, {})[model_name] = measure_decomposition(
                    model, tok, prompts, truths, args.decompose, group_size=args.group_size,
                    max_new_tokens=c.sampler.max_new_tokens, temperature=c.sampler.temperature, seed=args.seed,
                    max_cache_len=c.sampler.max_prompt_len + c.sampler.max_new_tokens)
            timings[f"{model_name}/{dtype}"] = time.perf_counter() - t0
            print(f"[mismatch_matrix] {model_name} {dtype}: {timings[f'{model_name}/{dtype}']:.0f}s", flush=True)
    return {"results": results, "decomposition": breakdown, "timings_s": timings,
            "settings": [dataclasses.asdict(s) for s in settings], "args": vars(args)}


# ------------------------------------------------------------------------------------------------ report

def _with_se(metrics: dict) -> str:
    se = metrics.get("se_abs_delta")
    v = f"{metrics['mean_abs_delta']:.3g}"
    return v if se is None or not math.isfinite(se) else f"{v} +- {se:.1g}"


def table(report: dict) -> str:
    """Markdown: one row per setting; for each model, the paper's value and ours per compute dtype."""
    res = report["results"]
    dtypes = list(res)
    models = list(next(iter(res.values())))
    header = ["learner / sampler", "measures"]
    for m in models:
        header.append(f"paper {'MoE' if 'moe' in m else 'dense'}")
        header += [f"{m} {d}" for d in dtypes]
    rows = []
    for s in _measured(report):
        row = [s.label, s.measures]
        for m in models:
            row.append(PAPER.get(s.label, {}).get(m))
            row += [_with_se(res[d][m][s.label]) for d in dtypes]
        rows.append(row)
    return common.markdown_table(header, rows)


def decomposition_table(report: dict) -> str:
    """Markdown: each decomposition step's mean |delta| per model and dtype (max |delta| where it is exactly 0)."""
    dec = report.get("decomposition") or {}
    cols = [(d, m) for d, per in dec.items() for m in per]
    if not cols:
        return ""
    steps = [r["step"] for r in dec[cols[0][0]][cols[0][1]]]

    def cell(r):
        v = r["mean_abs_delta"]
        flips = r.get("routing_flip_frac")
        text = "0 (max 0)" if r.get("max_abs_delta") == 0 else f"{v:.3g}"
        return text if flips is None else f"{text}, flips {100 * flips:.1f}%"

    rows = [[name] + [cell(dec[d][m][i]) for d, m in cols] for i, name in enumerate(steps)]
    return common.markdown_table(["step (a '+' row adds one source to the zero row above it)"]
                                 + [f"{m} {d}" for d, m in cols], rows)


def orderings_table(report: dict) -> str:
    """Each claim the paper's numbers decide: does it hold in the paper, here, and by how many standard errors."""
    out = []
    for dtype, per_model in report["results"].items():
        ours = {m: {k: v["mean_abs_delta"] for k, v in r.items()} for m, r in per_model.items()}
        se = {m: {k: v.get("se_abs_delta", math.nan) for k, v in r.items()} for m, r in per_model.items()}
        kinds = {name: (kind, arg) for name, kind, arg in ORDERINGS}
        for name, model, paper_holds, here in check_orderings(ours):
            kind, arg = kinds[name]
            if kind == "models":
                vals = {m: ours[m].get(arg) for m in ours if arg in ours[m]}
                z = claim_margin("chain", ("tiny_moe", "tiny"), vals, {m: se[m][arg] for m in vals})
            else:
                z = claim_margin(kind, arg, {k: v for k, v in ours[model].items()
                                             if k in {lb for lb, per in PAPER.items() if model in per}}, se[model])
            out.append([name, model, dtype, "yes" if paper_holds else "no",
                        "-" if here is None else ("yes" if here else "no"), "-" if z is None else f"{z:.1f}"])
    return common.markdown_table(["paper's ordering", "model", "dtype", "in the paper", "here", "min z"], out)


def _measured(report: dict) -> list[Setting]:
    """The SETTINGS rows the report holds (all of them unless --settings picked some), in table order."""
    per_model = next(iter(next(iter(report["results"].values())).values()))
    return [s for s in SETTINGS if s.label in per_model]


def bar_chart(report: dict, path: str) -> str:
    """Grouped bars of mean |delta| per setting: the paper's value and ours for each model (log scale)."""
    import numpy as np

    plt = common.use_agg()
    res = report["results"]
    models = list(next(iter(res.values())))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False)
    labels = [s.label for s in _measured(report)]
    x = np.arange(len(labels))
    for ax, m in zip(axes[0], models):
        series = [("paper", [PAPER.get(lb, {}).get(m, np.nan) for lb in labels], None)]
        series += [(f"here ({d})", [res[d][m][lb]["mean_abs_delta"] for lb in labels],
                    [res[d][m][lb].get("se_abs_delta", np.nan) for lb in labels]) for d in res]
        w = 0.8 / len(series)
        for j, (name, vals, err) in enumerate(series):
            ax.bar(x + (j - (len(series) - 1) / 2) * w, np.maximum(np.asarray(vals, float), 1e-7), w, label=name,
                   yerr=None if err is None else np.nan_to_num(np.asarray(err, float)), capsize=2)
        ax.set_yscale("log")
        ax.set_xticks(x, labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("mean |delta| (nats/token)")
        ax.set_title(f"{m}: learner/sampler mismatch at the start of RL", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(handles), bbox_to_anchor=(0.5, 0.98), fontsize=9)
    fig.tight_layout()
    return common.save_figure(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,tiny_moe", help="comma-separated config names (configs/NAME.py)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes to measure in")
    p.add_argument("--num_prompts", type=int, default=256, help="held-out synthetic problems")
    p.add_argument("--group_size", type=int, default=4, help="responses per problem (for the advantages)")
    p.add_argument("--seed", type=int, default=0, help="sampling key")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every model's config (repeatable), e.g. warmup.cache_dir=DIR")
    p.add_argument("--out", default=os.path.join(common.ROOT, "experiments", "results"),
                   help="folder for mismatch_matrix.json / .md")
    p.add_argument("--compile_cache", default=os.path.join(common.ROOT, "runs", "jax_cache"),
                   help="JAX persistent compilation cache folder ('' to disable)")
    p.add_argument("--settings", default="", help="comma-separated row labels to measure (default: every row of "
                                                    "SETTINGS), e.g. 'BF16 / BF16,MXFP4 / MXFP4'")
    p.add_argument("--decompose", default="w4a4", help="4-bit preset whose mismatch the decomposition table "
                                                          "takes apart, from exact mode up ('' to skip)")
    p.add_argument("--replot", action="store_true", help="re-render the table and figure from --out's JSON")
    p.add_argument("--figure", default=os.path.join(common.FIGURES, "mismatch_matrix.png"))
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    for d in args.dtypes:
        if d not in ("float32", "bfloat16"):
            p.error(f"--dtypes: {d!r} is not float32 or bfloat16")
    for name in ("num_prompts", "group_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.models:
        p.error("--models is empty")
    args.overrides = common.parse_overrides(p, args.overrides)
    from triage_jax.quant import PRESETS

    if args.decompose and (args.decompose not in PRESETS or not PRESETS[args.decompose].quantized):
        p.error(f"--decompose: {args.decompose!r} is not a quantized preset; one of "
                f"{sorted(k for k, v in PRESETS.items() if v.quantized)}")
    wanted = [lb.strip() for lb in args.settings.split(",") if lb.strip()]
    unknown = [lb for lb in wanted if lb not in LABELS]
    if unknown:
        p.error(f"--settings: unknown row(s) {unknown}; the rows are {list(LABELS)}")
    args.settings = [s.label for s in SETTINGS if not wanted or s.label in wanted]  # labels: args go to the JSON
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.replot:
        with open(os.path.join(args.out, "mismatch_matrix.json")) as f:
            report = json.load(f)
    else:
        with common.compile_cache(args.compile_cache):
            report = run(args)
        report["total_s"] = time.perf_counter() - t0
    text = ("## mean |delta| (learner log-prob - sampler log-prob), start of RL\n\n"
            "Measured value +- its standard error over responses. 'min z' below: the smallest measured difference "
            "between the rows a claim compares, in combined standard errors (under ~2: within sampling noise).\n\n"
            + table(report)
            + "\n\n## The paper's orderings at this scale\n\n" + orderings_table(report) + "\n")
    if decomposition_table(report):
        text += (f"\n## Where the {report['args']['decompose']} mismatch comes from: exact mode plus one source at "
                 "a time\n\n" + decomposition_table(report) + "\n")
    print(text)
    os.makedirs(args.out, exist_ok=True)
    if not args.replot:
        common.write_json(os.path.join(args.out, "mismatch_matrix.json"), report)
    with open(os.path.join(args.out, "mismatch_matrix.md"), "w") as f:
        f.write(text)
    print(f"figure: {bar_chart(report, args.figure)}  ({report['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
