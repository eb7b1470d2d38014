"""Memory-bounded attention for long sequences: query blocks x key blocks with an online softmax (flash-style).

`jax.nn.dot_product_attention`'s XLA path materializes float32 scores [B, N, T, S]; at T = S = 22,528 (a 2,048-token
prompt and a 20,480-token response) that is 65 GB per sequence per layer. Here a query block of `q_chunk` rows
scans over key blocks of `k_chunk` columns keeping a running max, sum and float32 accumulator, and both levels are
rematerialized in the backward pass, so the live scores are [B, N, q_chunk, k_chunk]. Same arithmetic as
`jax.nn.dot_product_attention` (float32 logits and softmax, masked logits set to its large negative number);
rows with no visible key (pads) average the values, as there. On GPU/TPU a fused kernel (cuDNN / splash
attention) does the same without the scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
NEG = -0.7 * float(jnp.finfo(F32).max)  # jax.nn.dot_product_attention's masked logit (float32 logits)


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def chunked_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array, *,
                      scale: float, q_chunk: int = 512, k_chunk: int = 1024) -> jax.Array:
    """softmax(q k^T * scale, masked) v with GQA (N query heads over K key/value heads) -> [B, T, N, H].

    mask_bts: bool [B, T, S] (or [B, 1, T, S]), True where query t may attend to key s.
    """
    if mask_bts.ndim == 4:
        mask_bts = mask_bts[:, 0]
    b, t, n, h = q_btnh.shape
    s, kh = k_bskh.shape[1], k_bskh.shape[2]
    if n % kh or mask_bts.shape != (b, t, s) or v_bskh.shape != k_bskh.shape:
        raise ValueError(f"chunked_attention: q {q_btnh.shape}, k {k_bskh.shape}, v {v_bskh.shape}, mask "
                         f"{mask_bts.shape} do not fit [B,T,N,H], [B,S,K,H] (N % K == 0), [B,T,S]")
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"chunked_attention: q_chunk={q_chunk}, k_chunk={k_chunk} must be positive")
    g = n // kh
    cq, ck = min(q_chunk, t), min(k_chunk, s)
    # Padded queries are dropped at the end; padded keys are masked out.
    q = _pad_to(q_btnh, 1, cq).reshape(b, -1, cq, kh, g, h).transpose(1, 0, 2, 3, 4, 5)  # [nq, B, Cq, K, G, H]
    mask = _pad_to(_pad_to(mask_bts, 1, cq, False), 2, ck, False)
    nq, nk = q.shape[0], mask.shape[2] // ck
    mask = mask.reshape(b, nq, cq, nk, ck).transpose(1, 3, 0, 2, 4)  # [nq, nk, B, Cq, Ck]
    k = _pad_to(k_bskh, 1, ck).reshape(b, nk, ck, kh, h).transpose(1, 0, 2, 3, 4)  # [nk, B, Ck, K, H]
    v = _pad_to(v_bskh, 1, ck).reshape(b, nk, ck, kh, h).transpose(1, 0, 2, 3, 4)
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q_btnh.dtype == jnp.bfloat16 else None

    @jax.checkpoint
    def q_block(args):
        q_bqkgh, mask_kbqc = args

        @jax.checkpoint
        def k_step(carry, blk):
            m_bkgq, l_bkgq, acc_bkgqh = carry
            k_bckh, v_bckh, mask_bqc = blk
            z = jnp.einsum("bqkgh,bckh->bkgqc", q_bqkgh, k_bckh, precision=precision, preferred_element_type=F32)
            z = jnp.where(mask_bqc[:, None, None], z * jnp.asarray(scale, F32), NEG)
            m_new = jnp.maximum(m_bkgq, jnp.max(z, axis=-1))
            p = jnp.exp(z - m_new[..., None])
            decay = jnp.exp(m_bkgq - m_new)
            l_new = l_bkgq * decay + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqc,bckh->bkgqh", p.astype(v_bckh.dtype), v_bckh, preferred_element_type=F32)
            return (m_new, l_new, acc_bkgqh * decay[..., None] + pv), None

        init = (jnp.full((b, kh, g, cq), -jnp.inf, F32), jnp.zeros((b, kh, g, cq), F32),
                jnp.zeros((b, kh, g, cq, h), F32))
        (_, l_bkgq, acc_bkgqh), _ = jax.lax.scan(k_step, init, (k, v, mask_kbqc))
        out_bkgqh = acc_bkgqh / l_bkgq[..., None]
        return out_bkgqh.transpose(0, 3, 1, 2, 4).reshape(b, cq, n, h).astype(q_btnh.dtype)

    out = jax.lax.map(q_block, (q, mask))  # [nq, B, Cq, N, H]
    return out.transpose(1, 0, 2, 3, 4).reshape(b, nq * cq, n, h)[:, :t]


class long_sequence_attention:
    """Context manager: within it, `jax.nn.dot_product_attention` calls with a mask and at least `min_len` queries
    (the learner's full-sequence forward) run `chunked_attention`; shorter ones (decode) are untouched.

    For the memory dry-run (`--attention=chunked`): it measures the learner once the model's attention calls
    `chunked_attention` for long sequences, without changing the model code.
    """

    def __init__(self, min_len: int = 4096, q_chunk: int = 512, k_chunk: int = 1024):
        self.min_len, self.q_chunk, self.k_chunk = min_len, q_chunk, k_chunk
        self._orig = None

    def __enter__(self):
        self._orig = orig = jax.nn.dot_product_attention

        def attention(query, key, value, bias=None, mask=None, *, scale=None, **kw):
            if mask is None or bias is not None or kw or query.shape[1] < self.min_len:
                return orig(query, key, value, bias, mask, scale=scale, **kw)
            return chunked_attention(query, key, value, mask, scale=query.shape[-1] ** -0.5 if scale is None
                                     else scale, q_chunk=self.q_chunk, k_chunk=self.k_chunk)

        jax.nn.dot_product_attention = attention
        return self

    def __exit__(self, *exc):
        jax.nn.dot_product_attention = self._orig
        return False
