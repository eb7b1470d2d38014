"""Write the experiment notebooks (.ipynb) from the cell sources below: `python experiments/notebooks/make_notebooks.py`.

Keeping the sources here makes the notebooks reviewable as code and regenerable; the .ipynb files are committed
without outputs. tests/test_notebooks.py executes them top to bottom with nbclient.
"""

from __future__ import annotations

import os
import sys

import nbformat
from nbformat import v4

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = """\
# Colab: uncomment to install the package from a clone of the repository.
# !git clone <this repository> triage-jax && pip install -e './triage-jax[test]' && %cd triage-jax
import os, sys

ROOT = os.path.abspath(os.environ.get("TRIAGE_JAX_ROOT", ".."))
while not os.path.exists(os.path.join(ROOT, "experiments", "common.py")) and ROOT != os.path.dirname(ROOT):
    ROOT = os.path.dirname(ROOT)
if not os.path.exists(os.path.join(ROOT, "experiments", "common.py")):
    ROOT = os.getcwd()
sys.path.insert(0, ROOT)

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import jax, jax.numpy as jnp
from experiments import common
%matplotlib inline
print("repo:", ROOT, "| jax", jax.__version__, jax.devices()[0].platform)"""


# ------------------------------------------------------------------------------------------------ (a) diagnostics

DIAGNOSTICS = [
    ("md", """\
# Direction and segment diagnostics of a GRPO run

Reads a run's TensorBoard scalars (tensorboardX event files under `run_dir/tb`) and its last checkpoint, and draws
the mismatch diagnostics of docs/rl_math.md#diagnostics:

1. **quadrant occupancy over time**: the share of response tokens in each (advantage sign, delta sign) quadrant,
   and their |A|-weighted mass; the amplifying regions are A+d+ and A-d-, `rho_asym` is their mass ratio;
2. **delta along responses, by segment**: the checkpoint's responses re-sampled, delta = learner - sampler log-prob
   per token, laid out by position with the TRIAGE segment boundaries, and per segment (mean delta, tail fraction);
3. **tail persistence**: whether tail-dense segments follow each other more often than chance.

Set `RUN_DIR` (or the environment variable `TRIAGE_RUN_DIR`) to a run folder, e.g. one made by
`experiments/stability.py` (`runs/stability/nvfp4/seed0`). Without one, the notebook trains a short run itself."""),
    ("code", SETUP),
    ("code", """\
RUN_DIR = os.environ.get("TRIAGE_RUN_DIR", "")  # e.g. os.path.join(ROOT, "runs/stability/nvfp4/seed0")

if not RUN_DIR:
    # No run given: a short NVFP4 run without correction on the tiny model (the warm-up is cached after the
    # first time). Segments of 8 tokens, so that the <= 24-token responses hold several.
    from triage_jax.trainer import Trainer
    c = common.absolute_paths(common.load_config("tiny"))
    common.set_values(c, {"run_dir": os.path.join(ROOT, "runs", "notebook_diagnostics"), "train.steps": 6,
                          "rl.correction": "none", "rl.triage.segment_len": 8, "rl.num_prompts": 4,
                          "rl.group_size": 8, "rl.mini_batch": 32, "rl.micro_batch": 32, "train.progress": False})
    tr = Trainer(c)
    tr.run()
    with open(os.path.join(c.run_dir, "config.json"), "w") as f:
        f.write(c.to_json(indent=1))
    RUN_DIR = c.run_dir
print("run:", RUN_DIR)"""),
    ("code", """\
scalars = common.read_scalars(os.path.join(RUN_DIR, "tb"))
cfg = common.config_from_json(os.path.join(RUN_DIR, "config.json"))
print(f"{len(scalars)} scalar tags; sampler {cfg.sampler.precision}, learner {cfg.learner.precision}, "
      f"correction {cfg.rl.correction}, segment_len {cfg.rl.triage.segment_len}")
print(sorted(t for t in scalars if t.startswith("mismatch/")))"""),
    ("md", """\
## 1. Quadrant occupancy over time

Token shares (left) ignore how strongly each token is pushed; the |A|-weighted masses (right) are what the policy
gradient sees. A GRPO update on a token with A < 0 and delta < 0 (A-d-) pushes its learner log-prob further
below the sampler's: that region, and A+d+, amplify the mismatch; A+d- and A-d+ contract it."""),
    ("code", """\
quads = ["Apos_dpos", "Apos_dneg", "Aneg_dpos", "Aneg_dneg"]
names = {"Apos_dpos": "A+ d+ (amplifying)", "Apos_dneg": "A+ d- (contracting)",
         "Aneg_dpos": "A- d+ (contracting)", "Aneg_dneg": "A- d- (amplifying)"}
fig, axes = plt.subplots(1, 3, figsize=(16, 4))
steps = scalars["reward/mean"][0]
for ax, kind in zip(axes[:2], ["quad_tok", "quad_mass"]):
    # A step with all-zero advantages has no |A| mass: not logged, drawn as a gap (0).
    ys = np.stack([common.aligned(scalars, f"mismatch/{kind}_{q}", steps) for q in quads])
    ax.stackplot(steps, np.nan_to_num(ys), labels=[names[q] for q in quads], alpha=0.85)
    ax.set_title("token share" if kind == "quad_tok" else "|A|-weighted mass share")
    ax.set_xlabel("step"); ax.set_ylim(0, 1)
axes[0].legend(fontsize=8, loc="lower left")
axes[2].plot(steps, common.aligned(scalars, "mismatch/rho_asym", steps), "o-", label="rho_asym")
axes[2].axhline(1.0, color="gray", ls=":")
axes[2].set_title("rho_asym = mass(A-d-) / mass(A+d+)"); axes[2].set_xlabel("step"); axes[2].legend()
plt.show()
tok_shares = np.stack([common.aligned(scalars, f"mismatch/quad_tok_{q}", steps) for q in quads]).sum(0)
print("token share in some quadrant (tokens with A = 0 or delta = 0 are in none):", np.round(tok_shares, 3))"""),
    ("md", """\
## 2. Delta along responses, by segment

Load the run's newest checkpoint, sample held-out problems with the run's sampler precision, and recompute the
log-probs with the learner's precision. Each row is one response (grouped by advantage sign), each column a
response position; dotted lines are the TRIAGE segment boundaries."""),
    ("code", """\
from triage_jax import build
from triage_jax.rl import segment_stats, gate_weights, mismatch_metrics

model, tok, step = build.load_policy(cfg)
prompts, truths = common.held_out_prompts(cfg, tok, 16)
out, adv, scored = common.sample(model, tok, prompts, truths, sampler=cfg.sampler.precision,
                                 kv=cfg.sampler.kv_cache, group_size=cfg.rl.group_size,
                                 max_new_tokens=cfg.sampler.max_new_tokens, temperature=cfg.sampler.temperature,
                                 seed=0, max_cache_len=cfg.sampler.max_prompt_len + cfg.sampler.max_new_tokens)
delta = common.delta_of(common.learner_logprobs(model, out, cfg.learner.precision,
                                                temperature=cfg.sampler.temperature), out)
tcfg = build.triage(cfg)
mask = np.asarray(out.mask)
d = np.where(mask, np.asarray(delta), np.nan)
adv_np = np.asarray(adv)
order = np.argsort(-adv_np, kind="stable")
print(f"checkpoint step {step}; {mask.shape[0]} responses, accuracy {float(scored.accuracy.mean()):.2f}, "
      f"mean |delta| {np.nanmean(np.abs(d)):.4f}")"""),
    ("code", """\
stats = segment_stats(delta, out.mask.astype(jnp.float32), tcfg)
seg_n, seg_dbar, seg_f = (np.asarray(x) for x in (stats.n, stats.dbar, stats.f))
L, T = tcfg.segment_len, d.shape[1]
lim = np.nanquantile(np.abs(d), 0.99) or 1e-3
fig, axes = plt.subplots(1, 3, figsize=(17, 6), gridspec_kw={"width_ratios": [3, 1.2, 1.2]})
im = axes[0].imshow(d[order], aspect="auto", cmap="RdBu", vmin=-lim, vmax=lim, interpolation="nearest")
for b in range(L, T, L):
    axes[0].axvline(b - 0.5, color="k", ls=":", lw=1)
n_pos = int((adv_np > 0).sum())
axes[0].axhline(n_pos - 0.5, color="green", lw=1.5)
axes[0].set_title(f"delta per token (rows: A > 0 above the green line, A <= 0 below)")
axes[0].set_xlabel("response position"); axes[0].set_ylabel("response")
plt.colorbar(im, ax=axes[0], fraction=0.03)
seg_d = np.where(seg_n[order] > 0, seg_dbar[order], np.nan)
seg_t = np.where(seg_n[order] > 0, seg_f[order], np.nan)
im1 = axes[1].imshow(seg_d, aspect="auto", cmap="RdBu", vmin=-lim, vmax=lim, interpolation="nearest")
axes[1].set_title("segment mean delta"); axes[1].set_xlabel("segment"); plt.colorbar(im1, ax=axes[1], fraction=0.05)
im2 = axes[2].imshow(seg_t, aspect="auto", cmap="magma", vmin=0, vmax=1, interpolation="nearest")
axes[2].set_title(f"segment tail fraction (delta < -{tcfg.tau_tail})"); axes[2].set_xlabel("segment")
plt.colorbar(im2, ax=axes[2], fraction=0.05)
plt.tight_layout(); plt.show()"""),
    ("md", """\
What TRIAGE would do with this batch: the gate weight of each token (1 off the A-d- region), renormalized per
response, and the batch's diagnostics."""),
    ("code", """\
alpha = np.asarray(gate_weights(adv, delta, out.mask.astype(jnp.float32), tcfg))
np.testing.assert_allclose((alpha * mask).sum(1), mask.sum(1), rtol=1e-5)  # gating never removes update mass
m = {k: float(v) for k, v in mismatch_metrics(adv, delta, out.mask.astype(jnp.float32), tcfg).items()}
print("alpha range on real tokens:", alpha[mask].min().round(3), "..", alpha[mask].max().round(3))
for k in ("mean_abs_delta", "frac_small", "delta_q05", "rho_asym", "tail_freq", "tail_top5_share",
          "tail_persistence", "hidden_by_mean"):
    print(f"{k:>18}: {m[k]:.4f}")"""),
    ("md", """\
## 3. Tail persistence over training

`tail_persistence` is P(next segment tail-dense | this one is) / P(tail-dense): 1 is chance, the paper reports
2.6x rising to 3.8-4.0x. NaN (gaps) at steps with no tail-dense segment followed by another real segment."""),
    ("code", """\
fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
for ax, key in zip(axes, ["mismatch/tail_persistence", "mismatch/tail_freq", "mismatch/delta_q05"]):
    if key in scalars:
        s, v = scalars[key]
        ax.plot(s, v, "o-")
    ax.set_title(key.split("/")[1]); ax.set_xlabel("step"); ax.grid(alpha=0.3)
axes[0].axhline(1.0, color="gray", ls=":", label="chance"); axes[0].legend()
plt.tight_layout(); plt.show()
n_logged = len(scalars.get("mismatch/tail_persistence", ([], []))[0])
print(f"tail persistence defined at {n_logged} of {len(scalars['reward/mean'][0])} steps")"""),
]


# ------------------------------------------------------------------------------------------------ (b) walkthrough

WALKTHROUGH = [
    ("md", """\
# NVFP4 quantization and TRIAGE gating, step by step

Part 1 quantizes a small tensor to NVFP4 with the package's bit-exact reference (`triage_jax.quant`): E2M1
element codes, E4M3 block scales over 16 elements, a float32 global scale, the packed bytes, and the error
against BF16, MXFP8 and token-wise (row) scaling. Part 2 runs TRIAGE's gate and repair on a toy batch whose
mismatch we choose by hand (docs/rl_math.md#triage)."""),
    ("code", SETUP),
    ("md", """\
## 1. NVFP4

A value is `e2m1 * s_block * (amax / 2688)`: E2M1 has 8 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign (4 bits);
each block of 16 shares an E4M3 scale `s_block`; one float32 `amax` per tensor sets the global scale
(2688 = 448 * 6, the largest E4M3 scale times the largest E2M1 value)."""),
    ("code", """\
from triage_jax.quant import formats as F
from triage_jax.quant import quantize_nvfp4, quantize_mxfp8

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 64)).astype(np.float32)
x[1, 5] = 12.0   # an outlier: its block's scale grows and its neighbours lose resolution
t = quantize_nvfp4(jnp.asarray(x))
print("E2M1 grid:", F.E2M1_GRID)
print("codes", t.codes.shape, t.codes.dtype, "| packed", t.packed.shape, t.packed.dtype,
      "| block scales", t.scale.shape, t.scale.dtype, "| amax", float(t.amax))
print("row 1, block 0 codes:", np.asarray(t.codes[1, :16]))
print("decoded E2M1 values:  ", np.asarray(F.e2m1_decode(t.codes[1, :16])))
print("block scales row 1:   ", np.asarray(t.decoded_scale()[1]))"""),
    ("md", """\
Packing: two 4-bit codes per byte, the even element in the low nibble. Codes 0-7 are the positive grid, 8-15 the
same magnitudes negated (bit 3 is the sign)."""),
    ("code", """\
codes = np.asarray(t.codes).astype(np.uint8)
packed = np.asarray(t.packed)
assert np.array_equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
print("first bytes of row 0:", [f"0x{b:02x}" for b in packed[0, :4]], "<- codes", codes[0, :8])
assert np.array_equal(np.asarray(F.e2m1_decode(codes)) < 0, (codes >= 8) & (codes != 8))  # -0 is code 8"""),
    ("md", "Dequantize by hand, in the order docs/numerics.md#nvfp4-dequantize gives, and compare with `NVFP4Tensor.dequantize`:"),
    ("code", """\
elem = np.asarray(F.e2m1_decode(t.codes))                       # [4, 64]
block = np.repeat(np.asarray(t.decoded_scale()), 16, axis=-1)   # [4, 64]
# Transformer Engine's order, all float32: final = (s * amax) * f32(1 / (6 * 448)), then e2m1 * final.
final = (block.astype(np.float32) * np.float32(t.amax)) * np.float32(1.0 / 2688.0)
manual = elem.astype(np.float32) * final
assert np.array_equal(manual, np.asarray(t.dequantize()))
xq = manual
err = np.abs(xq - x)
print(f"max |error| {err.max():.4f}, relative RMS error {np.sqrt((err**2).mean() / (x**2).mean()):.4f}")
print("block amax / block scale * g (each block's largest magnitude maps to ~6):",
      np.round(np.abs(x[1, :16]).max() / (np.asarray(t.decoded_scale())[1, 0] * float(t.amax) / 2688.0), 3))"""),
    ("md", "Error by format and scaling, on the same tensor:"),
    ("code", """\
def rel_rms(q):
    q = np.asarray(q, np.float32)
    return float(np.sqrt(((q - x) ** 2).mean() / (x ** 2).mean()))

rows = {
    "BF16": rel_rms(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)),
    "MXFP8 (E4M3, 32-blocks, pow2 scales)": rel_rms(quantize_mxfp8(jnp.asarray(x)).dequantize()),
    "NVFP4, tensor scaling": rel_rms(t.dequantize()),
    "NVFP4, row (token-wise) scaling": rel_rms(quantize_nvfp4(jnp.asarray(x), scaling="row").dequantize()),
}
for k, v in rows.items():
    print(f"{k:>38}: relative RMS error {v:.4f}")
blk_err = np.sqrt(((xq - x) ** 2).reshape(4, 4, 16).mean(-1))
fig, axes = plt.subplots(1, 2, figsize=(12, 3.5))
axes[0].scatter(x.ravel(), xq.ravel(), s=8)
axes[0].plot([-3, 3], [-3, 3], "k:", lw=1)
axes[0].set_xlim(-3.2, 3.2); axes[0].set_ylim(-3.2, 3.2)
axes[0].set_xlabel("x"); axes[0].set_ylabel("NVFP4(x)"); axes[0].set_title("the E2M1 staircase, scaled per block")
im = axes[1].imshow(blk_err, cmap="viridis"); plt.colorbar(im, ax=axes[1])
axes[1].set_title("RMS error per 16-block (row 1, block 0 holds the outlier)")
axes[1].set_xlabel("block"); axes[1].set_ylabel("row")
plt.tight_layout(); plt.show()
assert blk_err[1, 0] == blk_err.max()"""),
    ("md", """\
## 2. TRIAGE on a toy batch

Four responses of 24 tokens, segments of 8. Response 1 (A < 0) has a run of 8 tail tokens (delta well below
-tau_tail) straddling its 2nd and 3rd segments, so both are tail-dense and one follows the other; response 2 (A < 0)
has a mildly negative last segment; responses 0 and 3 have A > 0, and response 0 has a tail-dense middle segment.
Response 3 is 20 tokens long (padding after)."""),
    ("code", """\
from triage_jax.rl import TriageConfig, segment_stats, gate_weights, repair_loss, mismatch_metrics
from triage_jax.rl.triage import segment_weights

cfg = TriageConfig(segment_len=8, k_rep=0)
N, T = 4, 24
rng = np.random.default_rng(1)
delta = rng.normal(0.0, 0.01, (N, T)).astype(np.float32)
delta[1, 12:20] = -0.5   # tail tokens (below -tau_tail = -0.3) across segments 1 and 2
delta[0, 8:16] = -0.5    # the same, but A > 0: never gated
delta[2, 16:24] = -0.06  # mildly negative mean, no tail
mask = np.ones((N, T), np.float32); mask[3, 20:] = 0
adv = np.array([1.0, -1.0, -1.0, 0.5], np.float32)
st = segment_stats(delta, mask, cfg)
w_seg = np.asarray(segment_weights(st, cfg))
print("segment mean delta:\\n", np.round(np.asarray(st.dbar), 3))
print("segment tail fraction:\\n", np.round(np.asarray(st.f), 3))
print("segment weight w_S (applied only to A<0, delta<0 tokens):\\n", np.round(w_seg, 3))"""),
    ("code", """\
alpha = np.asarray(gate_weights(adv, delta, mask, cfg))
print("per-response sum of alpha*m vs tokens:", (alpha * mask).sum(1), mask.sum(1))
np.testing.assert_allclose((alpha * mask).sum(1), mask.sum(1), rtol=1e-5)
assert np.all(alpha[0] == 1.0) and np.all(alpha[3][mask[3] > 0] == 1.0)    # A > 0: untouched
assert alpha[1, 12:20].max() < alpha[1, :8].min()                          # the tail tokens are down-weighted
fig, axes = plt.subplots(1, 2, figsize=(13, 3))
im = axes[0].imshow(np.where(mask > 0, delta, np.nan), cmap="RdBu", vmin=-0.5, vmax=0.5, aspect="auto")
axes[0].set_title("delta"); plt.colorbar(im, ax=axes[0])
im = axes[1].imshow(np.where(mask > 0, alpha, np.nan), cmap="viridis", aspect="auto")
axes[1].set_title("TRIAGE alpha (renormalized per response)"); plt.colorbar(im, ax=axes[1])
for ax in axes:
    ax.set_yticks(range(N), [f"A={a:+.1f}" for a in adv])
    for b in (8, 16):
        ax.axvline(b - 0.5, color="k", ls=":")
plt.tight_layout(); plt.show()"""),
    ("md", """\
The bounded repair acts on A > 0 responses whose learner log-prob sits below the sampler's on average
(`q_i = max(0, tau_rep - mean(l_th - l_S))`), with a pseudo-Huber penalty: quadratic for small gaps, linear
(bounded gradient) for large ones. Here the learner is 0.5 nats below the sampler on response 0's middle segment:"""),
    ("code", """\
sampler_logp = np.full((N, T), -1.0, np.float32)
logp = sampler_logp + delta
rep = float(repair_loss(adv, logp, sampler_logp, mask, 0, cfg))
grad = np.asarray(jax.grad(lambda lp: repair_loss(adv, lp, sampler_logp, mask, 0, cfg))(jnp.asarray(logp)))
q0 = max(0.0, -float((delta[0] * mask[0]).sum() / mask[0].sum()))
print(f"response 0 gap q = {q0:.4f}; L_rep = {rep:.6f}")
# Negative gradient = descent raises those log-probs. Response 3 (A > 0, mean delta slightly below 0) gets a
# tiny push; the A < 0 responses 1 and 2 none.
print("summed gradient per response:", np.round(grad.sum(1), 5))
assert np.all(grad[0] < 0) and np.all(grad[1:3] == 0)
qs = np.linspace(0, 1, 101)
phi = cfg.beta**2 * (np.sqrt(1 + (qs / cfg.beta) ** 2) - 1)
plt.figure(figsize=(5, 3)); plt.plot(qs, phi, label="pseudo-Huber"); plt.plot(qs, qs**2 / 2, ":", label="q^2/2")
plt.ylim(0, 0.15); plt.xlabel("q"); plt.legend(); plt.title(f"repair penalty, beta = {cfg.beta}"); plt.show()"""),
    ("md", "The batch's mismatch diagnostics, as the trainer logs them every step:"),
    ("code", """\
m = {k: float(v) for k, v in mismatch_metrics(adv, delta, mask, cfg).items()}
for k in ("mean_abs_delta", "frac_small", "delta_q05", "rho_asym", "tail_freq", "tail_top5_share",
          "tail_persistence", "hidden_by_mean", "b_amp", "b_con"):
    print(f"{k:>16}: {m[k]:.4f}")
assert m["rho_asym"] > 1  # the A-d- mass (responses 1 and 2) outweighs A+d+
assert m["tail_persistence"] > 1  # response 1's adjacent tail-dense segments: above chance"""),
]


def build(cells) -> nbformat.NotebookNode:
    nb = v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["colab"] = {"provenance": []}
    nb.cells = [v4.new_markdown_cell(src) if kind == "md" else v4.new_code_cell(src) for kind, src in cells]
    for i, cell in enumerate(nb.cells):  # fixed ids (nbformat draws random ones), so regenerating changes nothing
        cell.id = f"cell-{i:02d}"
    return nb


NOTEBOOKS = {"run_diagnostics.ipynb": DIAGNOSTICS, "nvfp4_triage_walkthrough.ipynb": WALKTHROUGH}


def main(out_dir: str = HERE) -> list[str]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = build(cells)
        nbformat.validate(nb)
        path = os.path.join(out_dir, name)
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in main(*sys.argv[1:]):
        print(p)
