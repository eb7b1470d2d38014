"""Batch-invariant ops of exact mode: a token's numbers depend on that token's context alone, never on the other
rows of its batch, its padding, prefill vs decode, or the capacity of the KV cache it is read from.

XLA's CPU kernels choose their reduction order by shape: a row of a dot over fewer than 64 rows, a row sum over
40 logits at 1,000 rows vs 64, a sum over a middle axis at 8 columns vs 2 (docs/numerics.md#exact-mode lists the
measurements). Exact mode therefore
- runs every matmul on at least `MIN_ROWS` rows and `MIN_COLS` columns (zeros appended), inputs materialized
  first, the regime where the measured dot kernels give each row the same bits whatever the row count, and
- computes every other reduction in a fixed order of elementwise adds: `tree_sum` (a zero-padded power-of-two
  halving tree) or, over attention's head dim and 64-slot blocks, `chain_sum` (left to right, one fused loop).
  Zeros past the data leave either unchanged (x + 0 = x), so a sum over 64 cache slots equals the sum over 2,048
  when the extra slots are masked: capacity buckets do not matter. Summands are `rounded` first: the backend
  fuses a multiply into a following add (an FMA) wherever both land in one fusion, and which ops share a fusion
  depends on the program.
Attention and log-softmax built from these are what the sampler and the learner both run when
`PrecisionPolicy.exact` is set.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from triage_jax.models import kv_cache
from triage_jax.quant.ieee import rounded  # the FMA-contraction guard (quant/ieee.py owns it)

F32 = jnp.float32
BLOCK = kv_cache.BLOCK  # attention sums over slots per block of this many (the cache capacity granule)
MIN_ROWS = 64  # the dot kernels are row-count invariant from 64 rows on (docs/numerics.md#exact-mode)
MIN_COLS = 64  # ... and for outputs of >= 16 columns (float32: 2 and 8 columns are not); 64 with room
MAX_QUERY_CHUNKS = 8  # causal_attention's query chunks (unrolled: a few, whatever the length)


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over `axis` by pairwise halving of a zero-padded power-of-two length (fixed, shape-free order).

    The summands are `rounded` first: a product must not fuse into the first level's add."""
    axis = axis % x.ndim
    x = rounded(x)
    n = x.shape[axis]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, width - n)
        x = jnp.pad(x, pad)
    while width > 1:
        width //= 2
        x = jax.lax.slice_in_dim(x, 0, width, axis=axis) + jax.lax.slice_in_dim(x, width, 2 * width, axis=axis)
    return jnp.squeeze(x, axis)


def padded_cols(w_kn: jax.Array) -> jax.Array:
    """w with its output (last) axis zero-padded to >= MIN_COLS: float32 dots with < 16 columns are not row-count
    invariant (the router's 8 experts); cut the result back with `[..., :N]`."""
    n = w_kn.shape[-1]
    return w_kn if n >= MIN_COLS else jnp.pad(w_kn, [(0, 0)] * (w_kn.ndim - 1) + [(0, MIN_COLS - n)])


def padded_rows(fn, x_mk: jax.Array, *args, row_chunks: bool = True):
    """fn(x, *args) with x's leading (row) axis padded to >= MIN_ROWS zero rows, the result cut back to M rows.

    x enters through an optimization barrier, so it is materialized in its dtype first: fused into the matmul's
    operand quantization, XLA may keep a bfloat16 elementwise chain (the SwiGLU silu(g) * u) in float32 in one
    program and round it in another (the MoE experts differed between 1,358 and 8 routed rows).

    On every platform but the CPU, fn sees exactly MIN_ROWS rows: more rows go through in chunks of MIN_ROWS, one
    after another (`row_chunks`; False for a fn whose rows are not independent, the grouped dot). XLA:GPU picks a
    GEMM's split-K and tiling by its row count - compiled for an H200 (tools/gpu_aot.py, no autotuning), a
    [64, K] x [K, N] dot splits K in parts summed afterwards and a [256, K] one does not, at K = 256 and 2,560 -
    so only one row count gives a row the same bits in the sampler's programs and the learner's. XLA:CPU's dots
    are row-count invariant from 64 rows on (measured), and there the rows go through at once."""
    x_mk = jax.lax.optimization_barrier(x_mk)
    m = x_mk.shape[0]
    if m > MIN_ROWS and row_chunks:
        return jax.lax.platform_dependent(x_mk, *args, cpu=fn, default=functools.partial(_in_row_chunks, fn))
    if m >= MIN_ROWS:
        return fn(x_mk, *args)
    x_pk = jnp.pad(x_mk, [(0, MIN_ROWS - m)] + [(0, 0)] * (x_mk.ndim - 1))
    return fn(x_pk, *args)[:m]


def _in_row_chunks(fn, x_mk: jax.Array, *args) -> jax.Array:
    """fn over x's rows in chunks of exactly MIN_ROWS (the last zero-padded), one after another (lax.map: one
    compiled [MIN_ROWS, ...] program for every chunk), concatenated and cut back to M rows."""
    m = x_mk.shape[0]
    c = -(-m // MIN_ROWS)
    x_cpk = jnp.pad(x_mk, [(0, c * MIN_ROWS - m)] + [(0, 0)] * (x_mk.ndim - 1)).reshape(c, MIN_ROWS, *x_mk.shape[1:])
    y_cp = jax.lax.map(lambda x_pk: fn(x_pk, *args), x_cpk)
    return y_cp.reshape(c * MIN_ROWS, *y_cp.shape[2:])[:m]


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis in float32, the mean a `tree_sum`."""
    x32 = x.astype(F32)
    var = tree_sum(x32 * x32, -1)[..., None] / x.shape[-1]
    return x32 * jax.lax.rsqrt(var + eps)


def _shifted_exp(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """exp(z - max z) over the last axis, with the max and the exponentials in fusions of their own.

    Fused with the max's reduction, XLA picks the exponential's vectorization (and so its last bit) by the row
    count: rows of 8 router logits differ between 24 and 720 rows. A barrier keeps exp elementwise.
    Returns (exponentials, the max used: 0 for a row that is all -inf).
    """
    m = jnp.max(z, axis=-1, keepdims=True)
    z, m = jax.lax.optimization_barrier((z, jnp.where(jnp.isfinite(m), m, 0.0)))
    return jax.lax.optimization_barrier(jnp.exp(z - m)), m


def logsumexp(z: jax.Array) -> jax.Array:
    """log sum exp over the last axis: max (order-free), exponentials, a `tree_sum`."""
    e, m = _shifted_exp(z)
    return jnp.log(tree_sum(e, -1)) + m[..., 0]


def log_softmax_at(z_nv: jax.Array, tokens_n: jax.Array) -> jax.Array:
    """log_softmax(z)[token] per row, the normalizer from `logsumexp`."""
    picked = jnp.take_along_axis(z_nv, tokens_n.astype(jnp.int32)[..., None], axis=-1)[..., 0]
    return picked - logsumexp(z_nv)


def softmax(z: jax.Array) -> jax.Array:
    """softmax over the last axis, the denominator a `tree_sum`."""
    e, _ = _shifted_exp(z)
    return e / tree_sum(e, -1)[..., None]


def _blocked_slots(k_bksh, v_bksh, visible_bts):
    """Keys, values and visibility padded to a whole number of BLOCK slots (the padding invisible)."""
    pad = -k_bksh.shape[2] % BLOCK
    if pad:
        k_bksh, v_bksh = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (k_bksh, v_bksh))
        visible_bts = jnp.pad(visible_bts, ((0, 0), (0, 0), (0, pad)))
    return k_bksh, v_bksh, visible_bts


def chain_sum(term, n: int) -> jax.Array:
    """term(0) + term(1) + ... + term(n - 1), left to right, every term `rounded`: the order is fixed by the index
    alone, trailing zero terms change nothing, and the unrolled chain fuses into one loop (no [..., n] tensor of
    products is materialized, unlike a `tree_sum` of them). For short fixed axes: a head dim, a slot block."""
    acc = rounded(term(0))
    for i in range(1, n):
        acc = acc + rounded(term(i))
    return acc


def _attention(q_btnh, k_bksh, v_bksh, visible_bts, scale):
    k_bksh, v_bksh, visible_bts = _blocked_slots(k_bksh, v_bksh, visible_bts)
    b, t, n, h = q_btnh.shape
    kvh, s = k_bksh.shape[1], k_bksh.shape[2]
    g, nb = n // kvh, s // BLOCK
    # Operands with the summed axis leading, so that each term of a chain is a cheap slice.
    q_hbkgt = q_btnh.reshape(b, t, kvh, g, h).transpose(4, 0, 2, 3, 1).astype(F32)
    k_hbks = k_bksh.transpose(3, 0, 1, 2).astype(F32)
    scores = chain_sum(lambda i: q_hbkgt[i][..., None] * k_hbks[i][:, :, None, None, :], h) * scale  # [b,k,g,t,s]
    scores = jnp.where(visible_bts[:, None, None], scores, -jnp.inf)
    p, _ = _shifted_exp(scores)  # a query that sees nothing (a pad) gets zeros
    # Sums over slots: a chain within each BLOCK-slot block, then a tree over blocks, so a larger cache (more
    # all-zero blocks, or zero slots at a block's end) leaves every sum's bits as they are.
    p_cbkgtn = p.reshape(b, kvh, g, t, nb, BLOCK).transpose(5, 0, 1, 2, 3, 4)
    v_cbknd = v_bksh.reshape(b, kvh, nb, BLOCK, h).transpose(3, 0, 1, 2, 4).astype(F32)
    den = tree_sum(chain_sum(lambda c: p_cbkgtn[c], BLOCK), -1)  # [b,k,g,t]
    num = tree_sum(chain_sum(lambda c: p_cbkgtn[c][..., None] * v_cbknd[c][:, :, None, None], BLOCK), -2)
    out_bkgth = num / jnp.where(den > 0, den, 1.0)[..., None]
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)


def _reference_attention(q_btnh, k_bksh, v_bksh, visible_bts, scale):
    """The same attention through dots: its VJP is exact mode's backward (the forward bits are what must match)."""
    b, t, n, h = q_btnh.shape
    kvh = k_bksh.shape[1]
    q_bkgth = q_btnh.reshape(b, t, kvh, n // kvh, h).transpose(0, 2, 3, 1, 4).astype(F32)
    scores = jnp.einsum("bkgth,bksh->bkgts", q_bkgth, k_bksh.astype(F32)) * scale
    visible = visible_bts[:, None, None]
    scores = jnp.where(visible, scores, -1e30)
    out = jnp.einsum("bkgts,bksh->bkgth", jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0),
                     v_bksh.astype(F32))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q_btnh.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _exact_attention(q_btnh, k_bksh, v_bksh, visible_bts, scale):
    return _attention(q_btnh, k_bksh, v_bksh, visible_bts, scale)


def _exact_attention_fwd(q_btnh, k_bksh, v_bksh, visible_bts, scale):
    return _attention(q_btnh, k_bksh, v_bksh, visible_bts, scale), (q_btnh, k_bksh, v_bksh, visible_bts)


def _exact_attention_bwd(scale, res, g):
    q_btnh, k_bksh, v_bksh, visible_bts = res
    _, vjp = jax.vjp(lambda q, k, v: _reference_attention(q, k, v, visible_bts, scale), q_btnh, k_bksh, v_bksh)
    return (*vjp(g), None)


_exact_attention.defvjp(_exact_attention_fwd, _exact_attention_bwd)


def attention(q_btnh: jax.Array, k_bksh: jax.Array, v_bksh: jax.Array, visible_bts: jax.Array,
              scale: float) -> jax.Array:
    """GQA attention of T queries over S key slots, out [B, T, N, Dh]; visible_bts: bool, query t sees slot s.

    float32 throughout. A query's output depends only on the keys it sees and their slot indices (not on T, S
    beyond them, or the other rows), so prefill, decode and the learner's full forward agree bit for bit when they
    place a sequence's tokens at the same slots. The backward pass is the dot-based attention's (same math).
    """
    return _exact_attention(q_btnh, k_bksh, v_bksh, visible_bts, scale)


def causal_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, visible_bts: jax.Array,
                     scale: float) -> jax.Array:
    """`attention` of T tokens over themselves at slots 0..T-1, where no query sees a later slot (the learner's
    causal forward); keys and values [B, T, KVH, Dh].

    Each chunk of queries reads the key blocks up to its own end only, about half the work. The blocks it skips
    are exactly those whose terms are all zero, and a `tree_sum` is unchanged by trailing zeros, so every query
    gets `attention`'s bits (and so the sampler's, whatever its cache capacity).
    """
    t = q_btnh.shape[1]
    blocks = -(-t // BLOCK)
    chunk = BLOCK * -(-blocks // MAX_QUERY_CHUNKS)  # whole blocks, at most MAX_QUERY_CHUNKS chunks
    k_bksh, v_bksh = k_btkh.transpose(0, 2, 1, 3), v_btkh.transpose(0, 2, 1, 3)
    outs = [attention(q_btnh[:, lo:lo + chunk], k_bksh[:, :, :lo + chunk], v_bksh[:, :, :lo + chunk],
                      visible_bts[:, lo:lo + chunk, :lo + chunk], scale) for lo in range(0, t, chunk)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
