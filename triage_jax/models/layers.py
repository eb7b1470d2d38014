"""Building blocks: parameters with logical axes, the quantized linear, RMSNorm, embedding and rotate-half RoPE."""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from triage_jax.models import invariant
from triage_jax.quant import PrecisionPolicy, QuantizedWeight, qdot

F32 = jnp.float32
HIGH_POLICY = PrecisionPolicy()


class QuantizedKernel(nnx.Variable):
    """A kernel quantized once (a `quant.QuantizedWeight`): not trainable, not an `nnx.Param`."""


def make_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], names: tuple[str | None, ...], dtype, *,
               init: str = "normal", std: float = 0.02) -> nnx.Param:
    """A parameter carrying its logical axis names (`out_sharding` metadata, no eager placement)."""
    if len(names) != len(shape):
        raise ValueError(f"make_param: {len(names)} axis names {names} for shape {shape}")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def policy_or_default(policy: PrecisionPolicy | None) -> PrecisionPolicy:
    return HIGH_POLICY if policy is None else policy


class Linear(nnx.Module):
    """y[..., *out] = x[..., *in] @ W[*in, *out] through the quantized dot (HF's [out, in] is transposed on import).

    Multi-axis in/out shapes keep heads explicit in the parameter (e.g. w_dnh for q_proj); the matmul itself is
    always the 2D `qdot(x[..., K], w[K, N])`, so a pre-quantized kernel is stored as a 2D `QuantizedWeight`.
    """

    def __init__(self, in_dims: tuple[int, ...], out_dims: tuple[int, ...], names: tuple[str | None, ...],
                 path: str, *, dtype: str, param_dtype: str, std: float, rngs: nnx.Rngs):
        self.in_dims, self.out_dims, self.path, self.dtype = tuple(in_dims), tuple(out_dims), path, dtype
        self.kernel = make_param(rngs, self.in_dims + self.out_dims, names, param_dtype, std=std)

    @property
    def kn(self) -> tuple[int, int]:
        return math.prod(self.in_dims), math.prod(self.out_dims)

    def kernel_2d(self) -> jax.Array | QuantizedWeight:
        """The kernel as the [K, N] operand of qdot (a QuantizedWeight as is); stacked layers keep a leading L."""
        w = self.kernel.get_value()
        if isinstance(w, QuantizedWeight):
            return w
        lead = w.shape[: w.ndim - len(self.in_dims) - len(self.out_dims)]
        return w.reshape(*lead, *self.kn).astype(self.dtype)

    def __call__(self, x: jax.Array, policy: PrecisionPolicy | None = None) -> jax.Array:
        policy = policy_or_default(policy)
        n_in = len(self.in_dims)
        if x.shape[x.ndim - n_in:] != self.in_dims:
            raise ValueError(f"{self.path}: input {x.shape} does not end in {self.in_dims}")
        lead = x.shape[: x.ndim - n_in]
        prec, w = policy.for_layer(self.path), self.kernel_2d()
        dot = lambda x_mk: qdot(x_mk, w, prec, backend=policy.backend, name=self.path)  # noqa: E731
        if policy.exact:
            n = self.kn[1]
            if not isinstance(w, QuantizedWeight) and n < invariant.MIN_COLS:
                w_pad = invariant.padded_cols(w)
                dot = lambda x_mk: qdot(x_mk, w_pad, prec, backend=policy.backend, name=self.path)[:, :n]  # noqa
            y = invariant.padded_rows(dot, x.reshape(math.prod(lead), self.kn[0]))
        else:
            y = dot(x.reshape(*lead, self.kn[0]))
        return y.reshape(*lead, *self.out_dims)


class MergedLinear(nnx.Module):
    """Linears of one input as one quantized GEMM: their quantized-once kernels side by side along N
    (`quant.concat_prequantized`), the output split back into each part's (y_q, y_k, y_v). Made by
    `prequantize_model` in the sampler's copy where the parts share one precision, for a backend whose GEMM is one
    launch per weight (fp4_gemm) or whose 4-bit weights are decoded by a kernel each (xla, xla_int8: XLA's
    DotMerger merges the parts' GEMMs, not their decodes)."""

    def __init__(self, parts: Sequence[Linear], kernel: QuantizedWeight):
        self.in_dims = parts[0].in_dims
        self.out_dims = tuple(p.out_dims for p in parts)
        self.paths = tuple(p.path for p in parts)
        self.kernel = QuantizedKernel(kernel)

    def __call__(self, x: jax.Array, policy: PrecisionPolicy | None = None) -> tuple[jax.Array, ...]:
        return self.split(self.flat(x, policy))

    def split(self, y: jax.Array) -> tuple[jax.Array, ...]:
        """The flat output [..., N_q + N_k + ...] as the parts' outputs (y_q, y_k, y_v), each in its out_dims."""
        lead = y.shape[:-1]
        ends = list(itertools.accumulate(math.prod(o) for o in self.out_dims))
        return tuple(y[..., e - math.prod(o):e].reshape(*lead, *o) for e, o in zip(ends, self.out_dims))

    def flat(self, x: jax.Array, policy: PrecisionPolicy | None = None) -> jax.Array:
        """The parts' outputs side by side, [..., N_q + N_k + ...] (each part's flattened)."""
        policy = policy_or_default(policy)
        precs = {policy.for_layer(p) for p in self.paths}
        if len(precs) != 1 or policy.exact:
            raise ValueError(f"{'+'.join(self.paths)}: merged for one precision (not exact mode), but this policy "
                             f"gives {sorted(map(str, precs))}{' in exact mode' if policy.exact else ''}; prepare the "
                             "sampler's copy (prequantize_model) with the policy it runs under")
        n_in = len(self.in_dims)
        if x.shape[x.ndim - n_in:] != self.in_dims:
            raise ValueError(f"{'+'.join(self.paths)}: input {x.shape} does not end in {self.in_dims}")
        lead = x.shape[: x.ndim - n_in]
        return qdot(x.reshape(*lead, math.prod(self.in_dims)), self.kernel.get_value(), precs.pop(),
                    backend=policy.backend, name="+".join(self.paths))


class RMSNorm(nnx.Module):
    """HF Qwen3RMSNorm: normalize in float32, cast back to the input dtype, then multiply by the weight."""

    def __init__(self, dim: int, eps: float, names: tuple[str | None, ...], *, dtype: str, param_dtype: str):
        self.eps, self.dtype = eps, dtype
        self.weight = make_param(None, (dim,), names, param_dtype, init="ones")

    def normalize(self, x: jax.Array, policy: PrecisionPolicy | None = None) -> jax.Array:
        """x normalized over its last axis, in x's dtype, before the weight."""
        if policy is not None and policy.exact:
            return invariant.rms_norm(x, self.eps).astype(x.dtype)
        x32 = x.astype(F32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        return (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)

    def __call__(self, x: jax.Array, policy: PrecisionPolicy | None = None) -> jax.Array:
        return self.weight[...].astype(x.dtype) * self.normalize(x, policy)


class Embed(nnx.Module):
    """Token embedding table [V, D]; `attend` is the tied LM head's kernel view."""

    def __init__(self, vocab: int, dim: int, *, dtype: str, param_dtype: str, std: float, rngs: nnx.Rngs):
        self.vocab, self.dtype = vocab, dtype
        self.embedding = make_param(rngs, (vocab, dim), ("vocab", "embed"), param_dtype, std=std)

    def __call__(self, ids_bt: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids_bt, axis=0).astype(self.dtype)


def rope_cos_sin(positions_bt: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, head_dim] as HF computes them: float32 angles, duplicated halves, cast to the compute dtype."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=F32) / head_dim))
    freqs = positions_bt.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x_btnh: jax.Array, cos_bth: jax.Array, sin_bth: jax.Array) -> jax.Array:
    """Rotate-half RoPE: x * cos + rotate_half(x) * sin, broadcast over heads, both products `rounded` before the
    add, as torch computes it. XLA contracts one product into the add as an FMA in some programs and not in others
    (which depends on the whole program's fusions and on the CPU's vector ISA), and the sampler's copy and the
    learner are different programs: unguarded, their q and k differed in the last bit (docs/numerics.md)."""
    half = x_btnh.shape[-1] // 2
    rot = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
    a, b = x_btnh * cos_bth[:, :, None, :], rot * sin_bth[:, :, None, :]
    return invariant.rounded(a) + invariant.rounded(b)
