"""KV cache for decoding: per layer [B, KVH, S, Dh] keys and values, rows filled from slot 0, and per-row lengths.

Layout: heads come before slots, the layout the attention contractions read directly (on the CPU a free reshape
into 64-slot blocks, 'bkqh,bknch->bknqc' and 'bknqc,bkncd->bknqd'; elsewhere 'bkqh,bksh->bkqs'): no per-step
transpose of the cache.

A layer's keys and values are either one [2, B, KVH, S, Dh] buffer (`combined`, the layout off the CPU: a step
writes both with one scatter, and XLA:GPU runs each scatter as a kernel of its own, so one launch a layer less per
decode step; the attention's GEMMs read the two leading slices without a copy) or two buffers (`combined=False`,
the CPU's layout: XLA:CPU copies each slice of a combined buffer out before its dot, the whole cache every step).
The layers are either a tuple (unrolled models: each layer updates its own buffers in place, and reads them
without a copy) or stacked along a leading L (`stacked=True`, the default for scan_layers models: the scan carries
the stack, writes each layer's new tokens into it in place and reads layer i as a dynamic slice; a tuple would
have to be stacked and unstacked around the scan, two copies of the whole cache per step). Every form holds the
same values and works with either model; `map_layers` applies a per-buffer function to any.

Rows hold their tokens at slots [0, lengths[b]); new tokens go to slots lengths[b] + t (a scatter, so every row
can sit at its own position: the rollout engine's slots). Bad or pad tokens of a write (mask 0) must come after
its real ones (right padding): only the real ones advance the row's length.

FP8 (E4M3) stores a per-layer per-tensor scale set by the first write into the layer (scale == 0 marks "unset"),
as amax(real tokens of that write) * headroom / 448, so the prefill sets it with `headroom` (default 2x) of room
for later tokens; every later write reuses it and clips to +-448 before the cast
(docs/numerics.md#fp8-per-tensor-and-the-kv-cache). A calibrated scale can be fixed with `fp8_scale=s`. A cache
whose every scale is known to be set (the engine's, in its decode rounds: an insertion's prefill set them) says
so with the static `scales_set`, and its writes skip the first-write amax (two reductions a layer per step).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint
from flax import struct

from triage_jax.models.config import ModelConfig
from triage_jax.models.sharding import batch_split
from triage_jax.quant import ieee

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
KV_FORMATS = ("bf16", "f32", "fp8")
BLOCK = 64  # cache capacity granule: attention reduces over fixed 64-slot blocks (see `cached_attention`)


@struct.dataclass
class KVCache:
    """kv: the keys and values. `combined`: a per-layer tuple of [2, B, KVH, S, Dh] arrays (keys at 0, values at 1)
    or one stacked [L, 2, B, KVH, S, Dh] array; else a per-layer tuple of (keys, values) pairs of [B, KVH, S, Dh]
    or one stacked (keys, values) pair of [L, B, KVH, S, Dh]. k_scale, v_scale: float32 scales (1.0 unless fp8),
    as the layers are: per-layer tuples of scalars or stacked [L] arrays (a layer's scale a buffer of its own, not
    a slice: XLA:GPU copies a slice of an [L] array out before a GEMM fusion reads it, two copies a layer per
    decode step; a stacked cache's layer reads its scales by `layer_row`); lengths: [B]."""

    kv: tuple | jax.Array
    k_scale: jax.Array
    v_scale: jax.Array
    lengths: jax.Array  # int32 [B]: tokens each row holds (at slots [0, lengths))
    fp8_headroom: float = struct.field(pytree_node=False, default=2.0)
    scales_set: bool = struct.field(pytree_node=False, default=False)  # static: every layer's FP8 scale is > 0
    combined: bool = struct.field(pytree_node=False, default=True)  # static: one buffer a layer (see kv)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.kv if self.combined else self.kv[0], tuple)

    @property
    def is_fp8(self) -> bool:
        return jax.tree.leaves(self.kv)[0].dtype == FP8

    @property
    def max_len(self) -> int:
        return jax.tree.leaves(self.kv)[0].shape[-2]

    @property
    def batch(self) -> int:
        return jax.tree.leaves(self.kv)[0].shape[-4]

    @property
    def num_layers(self) -> int:
        return len(self.kv) if self.combined or not self.stacked else len(self.kv[0])

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Layer i's (keys, values) buffers [B, KVH, S, Dh]; i may be traced when the cache is stacked."""
        if not self.stacked:
            kv = self.kv[i]
        elif self.combined:
            kv = jax.lax.dynamic_index_in_dim(self.kv, i, keepdims=False)
        else:
            kv = tuple(jax.lax.dynamic_index_in_dim(b, i, keepdims=False) for b in self.kv)
        return kv[0], kv[1]

    def scales(self, i) -> tuple[jax.Array, jax.Array]:
        """Layer i's (key scale, value scale); i may be traced when the cache is stacked (`layer_row`)."""
        if not self.stacked:
            return self.k_scale[i], self.v_scale[i]
        return layer_row(self.k_scale, i), layer_row(self.v_scale, i)

    def write(self, i, k_btkh: jax.Array, v_btkh: jax.Array, mask_bt: jax.Array, slot_bt: jax.Array) -> KVCache:
        """The cache with layer i's T new keys and values at slots slot_bt[b, t] of row b (see `write_slots`); i may
        be traced when the cache is stacked (a scatter into the stacked buffer: no copy of the layer)."""
        kw = dict(headroom=self.fp8_headroom, scale_set=self.scales_set)
        if self.stacked:
            kv, ks, vs = write_slots(self.kv, *self.scales(i), k_btkh, v_btkh, mask_bt, slot_bt, layer=i, **kw)
        else:
            kv_l, ks, vs = write_slots(self.kv[i], *self.scales(i), k_btkh, v_btkh, mask_bt, slot_bt, **kw)
            kv = self.kv[:i] + (kv_l,) + self.kv[i + 1:]
        out = self.replace(kv=kv)
        if not self.is_fp8 or self.scales_set:  # only FP8 sets a scale (at the first write); storing the others'
            return out  # 1.0 again would cost the decode step two small kernels a layer
        if isinstance(self.k_scale, tuple):
            return out.replace(k_scale=self.k_scale[:i] + (ks,) + self.k_scale[i + 1:],
                               v_scale=self.v_scale[:i] + (vs,) + self.v_scale[i + 1:])
        # A select, not .at[i].set: XLA:GPU runs an update of a slice in place as a dynamic-slice copy outside the
        # step's CUDA graph (two graph breaks a layer).
        at_i = jnp.arange(self.k_scale.shape[0]) == i
        return out.replace(k_scale=jnp.where(at_i, ks, self.k_scale), v_scale=jnp.where(at_i, vs, self.v_scale))


def layer_row(stack_l: jax.Array, i) -> jax.Array:
    """stack_l[i] for a (traced) layer index i, by `row_by_mask`: the row's exact bits (see `layer_rows`)."""
    if isinstance(i, int):
        return stack_l[i]
    return row_by_mask(stack_l, i)[0]


def layer_rows(stacks_l: list[jax.Array], i) -> list[jax.Array]:
    """[s[i] for s in stacks_l] (each [L, ...], a type of <= 4 bytes) for a traced layer index i: their rows' exact
    bits from one `row_by_mask` of all of them as uint32 words side by side (one small reduction).

    In a loop over stacked layers XLA:GPU runs a dynamic slice of a loop-carried array as a copy of its own outside
    the CUDA graphs (a DynamicSliceFusion memcpy) wherever its consumer cannot take a slice, e.g. a norm's Triton
    fusion; the masked sum is a kernel inside the graph. For small rows only (norm weights, scales): every layer's
    rows are read."""
    if not stacks_l:
        return []
    words = [_to_words(s.reshape(s.shape[0], -1)) for s in stacks_l]
    row = row_by_mask(jnp.concatenate(words, axis=1), i)[0]
    out, at = [], 0
    for s, w in zip(stacks_l, words):
        out.append(_from_words(row[at:at + w.shape[1]], s.dtype, math.prod(s.shape[1:])).reshape(s.shape[1:]))
        at += w.shape[1]
    return out


def _to_words(s: jax.Array) -> jax.Array:
    """s [..., n] (a type of <= 4 bytes) as uint32 words [..., W] along its last axis: its bits, 4 / itemsize
    narrow values to a word where they divide n evenly, else one a word."""
    size = jnp.dtype(s.dtype).itemsize
    if size > 4:
        raise ValueError(f"{s.dtype} ({size} bytes) does not fit a uint32 word")
    u = s if jnp.issubdtype(s.dtype, jnp.unsignedinteger) else jax.lax.bitcast_convert_type(s, _UNSIGNED[size])
    if _packs(size, s.shape[-1]):  # the row's own bytes: an all-reduce of it moves no padding
        return jax.lax.bitcast_convert_type(u.reshape(*u.shape[:-1], -1, 4 // size), jnp.uint32)
    return u.astype(jnp.uint32)


def _packs(size: int, n: int) -> bool:
    """Whether n values of `size` bytes go 4 / size to a uint32 word (else one a word)."""
    return size < 4 and n % (4 // size) == 0


def _from_words(w: jax.Array, dtype, n: int) -> jax.Array:
    """_to_words' inverse: words [..., W] -> [..., n] of `dtype`."""
    size = jnp.dtype(dtype).itemsize
    if _packs(size, n):
        u = jax.lax.bitcast_convert_type(w, _UNSIGNED[size]).reshape(*w.shape[:-1], n)
    else:
        u = w.astype(_UNSIGNED[size])
    return u if u.dtype == dtype else jax.lax.bitcast_convert_type(u, dtype)


def init_kv_cache(cfg: ModelConfig, batch: int, max_len: int, *, kv_format: str = "bf16", dtype=None,
                  fp8_scale: float | None = None, fp8_headroom: float = 2.0, stacked: bool | None = None,
                  combined: bool | None = None) -> KVCache:
    """An empty cache. kv_format "bf16" stores `dtype` (default bfloat16; "f32" or dtype=float32 for exact tests);
    stacked (default: cfg.scan_layers) stores the layers along a leading L; combined (default: off on a CPU
    process, see `combined_default`) stores a layer's keys and values in one buffer."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"init_kv_cache: kv_format={kv_format!r}; expected one of {KV_FORMATS}")
    if batch <= 0 or max_len <= 0:
        raise ValueError(f"init_kv_cache: batch={batch} and max_len={max_len} must be positive")
    if fp8_headroom < 1.0:
        raise ValueError(f"init_kv_cache: fp8_headroom={fp8_headroom} must be >= 1")
    if kv_format == "fp8":
        store = FP8
        scale0 = 0.0 if fp8_scale is None else float(fp8_scale)
    else:
        store = jnp.dtype(dtype) if dtype is not None else (F32 if kv_format == "f32" else jnp.bfloat16)
        scale0 = 1.0
    combined = combined_default() if combined is None else bool(combined)
    shape = (2,) * combined + (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
    layers = cfg.num_hidden_layers
    if cfg.scan_layers if stacked is None else stacked:
        kv = jnp.zeros((layers, *shape), store) if combined else tuple(jnp.zeros((layers, *shape), store)
                                                                       for _ in "kv")
        scales = jnp.full((layers,), scale0, F32)
    else:
        kv = tuple(jnp.zeros(shape, store) if combined else (jnp.zeros(shape, store), jnp.zeros(shape, store))
                   for _ in range(layers))
        scales = tuple(jnp.full((), scale0, F32) for _ in range(layers))
    return KVCache(kv=kv, k_scale=scales, v_scale=scales, lengths=jnp.zeros((batch,), jnp.int32),
                   fp8_headroom=float(fp8_headroom), combined=combined)


def combined_default(platform: str | None = None) -> bool:
    """Whether a cache for devices of `platform` (default: this process's default backend) stores a layer's keys
    and values in one buffer: everywhere but on a CPU (module docstring)."""
    return (platform or jax.default_backend()) != "cpu"


def map_layers(fn, cache: KVCache, *others: KVCache) -> KVCache:
    """`cache` with each key and value buffer replaced by fn(buffer, the other caches' same buffers...), fn written
    for one [B, KVH, S, Dh] buffer (vmapped over a combined buffer's keys / values and a stack's layers); the other
    caches have this one's layout."""
    f = jax.vmap(fn) if cache.combined else fn
    f = jax.vmap(f) if cache.stacked else f
    return cache.replace(kv=jax.tree.map(f, cache.kv, *(o.kv for o in others)))


def stack(cache: KVCache) -> KVCache:
    """The same cache in the stacked form (a copy unless it is stacked already)."""
    if cache.stacked:
        return cache
    kv = jnp.stack(cache.kv) if cache.combined else tuple(jnp.stack(b) for b in zip(*cache.kv))
    return cache.replace(kv=kv, k_scale=jnp.stack(cache.k_scale), v_scale=jnp.stack(cache.v_scale))


def unstack(cache: KVCache) -> KVCache:
    """The same cache as a tuple of per-layer buffers (a copy unless it is one already)."""
    if not cache.stacked:
        return cache
    kv = tuple(cache.kv) if cache.combined else tuple(zip(*(tuple(b) for b in cache.kv)))
    return cache.replace(kv=kv, k_scale=tuple(cache.k_scale), v_scale=tuple(cache.v_scale))


def fp8_write_scale(current: jax.Array, x_btkh: jax.Array, mask_bt: jax.Array, headroom: float) -> jax.Array:
    """The layer's scale after this write: kept if set, else amax(real tokens) * headroom / 448, or 1.0 where that
    is 0 (all zero, or an amax so small that the scale flushes to zero): a set scale is always > 0."""
    amax = jnp.max(jnp.where(mask_bt[:, :, None, None], jnp.abs(ieee.ftz(x_btkh.astype(F32))), 0.0))
    fresh = ieee.ftz(amax * (headroom / FP8_MAX))
    fresh = jnp.where(fresh > 0, fresh, 1.0)
    return jnp.where(current > 0, current, fresh).astype(F32)


def quantize_fp8_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """E4M3 codes of x / scale, clipped to +-448 before the cast (an out-of-range cast is not saturating)."""
    return jnp.clip(ieee.div(x.astype(F32), scale), -FP8_MAX, FP8_MAX).astype(FP8)  # IEEE division (quant/ieee.py)


def write_slots(kv, k_scale: jax.Array, v_scale: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
                mask_bt: jax.Array, slot_bt: jax.Array, headroom: float, layer=None,
                scale_set: bool = False) -> tuple:
    """Write the T new keys and values of one layer to slots slot_bt[b, t] of row b; returns (kv, k_scale,
    v_scale). kv: one [2, B, KVH, S, Dh] buffer (both written by one scatter) or a (keys, values) pair of
    [B, KVH, S, Dh]; with `layer` (an int or a traced scalar) a stack of them along a leading L, written at that
    layer. `scale_set` (static): the FP8 scales are known to be set (> 0), so they are used as they are.

    Pad tokens (mask 0) are written too (harmless: they sit at or past the row's new length, which they do not
    advance); a slot past the capacity is dropped.
    """
    buf = jax.tree.leaves(kv)[0]
    if buf.dtype == FP8:
        if not scale_set:
            k_scale = fp8_write_scale(k_scale, k_btkh, mask_bt, headroom)
            v_scale = fp8_write_scale(v_scale, v_btkh, mask_bt, headroom)
        k_st, v_st = quantize_fp8_kv(k_btkh, k_scale), quantize_fp8_kv(v_btkh, v_scale)
    else:
        k_st, v_st = k_btkh.astype(buf.dtype), v_btkh.astype(buf.dtype)
    rows_b1 = jnp.arange(buf.shape[-4], dtype=jnp.int32)[:, None]
    # Advanced indices (rows, slots) around the head slice: the update is indexed [B, T, KVH, Dh], as k_btkh is (the
    # broadcast advanced dimensions first, then the sliced ones); a combined buffer's keys / values axis is one more
    # slice ([B, T, 2, KVH, Dh]) and a layer index in front one more advanced index (the same update shape).
    lead = () if layer is None else (layer,)
    index = (rows_b1, slice(None), slot_bt)
    if isinstance(kv, tuple):
        return (scatter_set(kv[0], (*lead, *index), k_st), scatter_set(kv[1], (*lead, *index), v_st)), k_scale, v_scale
    return scatter_set(kv, (*lead, slice(None), *index), jnp.stack([k_st, v_st], axis=2)), k_scale, v_scale


def scatter_set(buf: jax.Array, index, values: jax.Array) -> jax.Array:
    """buf.at[index].set(values, mode="drop"), moving the bits of a 1- or 2-byte float buffer (bf16, fp8) as
    same-width unsigned integers: a copy, so the same values, but XLA:CPU scatters those types by converting the
    whole buffer to float32 and back (two float32 copies of every layer's cache, in the decode loop and the
    insertion); an integer scatter updates the buffer in place."""
    dt = jnp.dtype(buf.dtype)
    if not jnp.issubdtype(dt, jnp.floating) or dt.itemsize > 2:
        return buf.at[index].set(values.astype(dt), mode="drop")
    bits = {1: jnp.uint8, 2: jnp.uint16}[dt.itemsize]
    out = jax.lax.bitcast_convert_type(buf, bits).at[index].set(
        jax.lax.bitcast_convert_type(values.astype(dt), bits), mode="drop")
    return jax.lax.bitcast_convert_type(out, dt)


def read(buf_bksh: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """One layer's keys (or values) [B, KVH, S, Dh] in the compute dtype (dequantized when fp8)."""
    if buf_bksh.dtype == FP8:
        return ieee.ftz(buf_bksh.astype(F32) * ieee.ftz(scale)).astype(dtype)
    return buf_bksh.astype(dtype)


def resize(cache: KVCache, max_len: int) -> KVCache:
    """The same cache with capacity `max_len` (zero-padded or cut; every row must fit: lengths <= max_len)."""
    s = cache.max_len

    def fit(x):  # one [B, KVH, S, Dh] buffer
        if max_len >= s:
            return jnp.pad(x, ((0, 0), (0, 0), (0, max_len - s), (0, 0)))
        return x[:, :, :max_len]

    return map_layers(fit, cache)


# attention_in_place up to this many query heads per KV head: XLA:GPU's cost model (jaxlib 0.10.2) fuses a layer's
# slice of the stacked cache into the reductions at 2 and 4 (Qwen3 dense), and at 8 (30B-A3B) copies it out first,
# as before the GEMMs (`python -m triage_jax.tools.gpu_aot decode --scan-layers`, its `kv copies`).
IN_PLACE_MAX_GROUP = 4


@functools.partial(jax.jit, static_argnames=("scale", "stacked"))  # traced once per shape, not once per layer
def cached_attention(q_btnh: jax.Array, k_buf: jax.Array, v_buf: jax.Array, q_slot_bt: jax.Array,
                     scale: float, k_scale: jax.Array | float = 1.0, v_scale: jax.Array | float = 1.0, *,
                     stacked: bool = False) -> jax.Array:
    """Causal attention of T new queries (at slots q_slot_bt) over one layer's cache buffers [B, KVH, S, Dh] (FP8
    with their per-tensor scales, or the compute dtype): out [B, T, N, Dh].

    A query sees the slots <= its own (rows are filled from slot 0, so that is exactly its real context). GQA by
    grouping the N query heads per KV head, float32 scores and softmax, the cache read in the compute dtype with
    float32 accumulation (no per-step float32 copy of the cache). Forms of one computation, picked by the
    platform the program is lowered for: `attention_blocks` on the CPU (on the cache as `read` dequantizes it),
    `attention_rows` elsewhere (a GPU runs it in 3 kernels instead of 6), and there `attention_in_place` for one
    new token a row when the buffers are a layer of a stacked cache (`stacked`: a scanned model's decode step) and
    a KV head has at most IN_PLACE_MAX_GROUP query heads. They agree to float rounding; each row's result depends
    on that row alone in all, so a request's bits never depend on its slot or the other requests."""
    if k_buf.shape[2] % BLOCK:
        raise ValueError(f"cached_attention: cache capacity {k_buf.shape[2]} is not a multiple of {BLOCK}")

    def blocks(q, kb, vb, slot, ks, vs):
        return attention_blocks(q, read(kb, ks, q.dtype), read(vb, vs, q.dtype), slot, scale=scale)

    g = q_btnh.shape[2] // k_buf.shape[1]
    in_place = stacked and q_btnh.shape[1] == 1 and g <= IN_PLACE_MAX_GROUP
    gpu = attention_in_place if in_place else attention_rows
    return jax.lax.platform_dependent(q_btnh, k_buf, v_buf, q_slot_bt, jnp.float32(k_scale), jnp.float32(v_scale),
                                      cpu=blocks, default=functools.partial(gpu, scale=scale))


def _queries_per_kv_head(q_btnh: jax.Array, kvh: int, dtype) -> jax.Array:
    """[B, KVH, G * T, Dh]: the G * T queries of each KV head as one matrix dimension (query g * T + t)."""
    b, t, n, h = q_btnh.shape
    q_bkgth = q_btnh.reshape(b, t, kvh, n // kvh, h).transpose(0, 2, 3, 1, 4)
    return q_bkgth.reshape(b, kvh, n // kvh * t, h).astype(dtype)


def _heads_back(out_bkqh: jax.Array, t: int, dtype) -> jax.Array:
    """The inverse of _queries_per_kv_head: [B, KVH, G * T, Dh] -> [B, T, N, Dh]."""
    b, kvh, gt, h = out_bkqh.shape
    out_btkgh = out_bkqh.reshape(b, kvh, gt // t, t, h).transpose(0, 3, 1, 2, 4)
    return out_btkgh.reshape(b, t, kvh * gt // t, h).astype(dtype)


def attention_blocks(q_btnh: jax.Array, k_bksh: jax.Array, v_bksh: jax.Array, q_slot_bt: jax.Array,
                     scale: float) -> jax.Array:
    """cached_attention on the CPU: the sums over slots run per 64-slot block, then over blocks, which keeps the
    result's bits independent of the capacity S in the cases measured (T = 1, batch 8, S >= 128) but not in all:
    XLA's CPU reductions choose their order by shape, so across capacity buckets a log-prob can differ in its last
    bit (tokens do not, in every test here).

    Layout: the G * T queries of a KV head are one matrix dimension and the 64-slot blocks a batch dimension of
    both contractions ('bkqh,bknch->bknqc', 'bknqc,bkncd->bknqd'), so each is a plain batched matmul over
    (row, KV head, block): no transpose of the probabilities, 3-5x faster on CPU than blocks as a free dimension.
    The probabilities enter the value product unnormalized, in the cache's dtype (float32 caches: exact), and the
    sum is divided out after it.
    """
    b, t, n, h = q_btnh.shape
    kvh, s = k_bksh.shape[1], k_bksh.shape[2]
    g, nb = n // kvh, s // BLOCK
    q_bkqh = _queries_per_kv_head(q_btnh, kvh, k_bksh.dtype)
    scores = jnp.einsum("bkqh,bknch->bknqc", q_bkqh, k_bksh.reshape(b, kvh, nb, BLOCK, h),
                        preferred_element_type=F32) * scale
    slot_1n1c = jnp.arange(s, dtype=jnp.int32).reshape(1, nb, 1, BLOCK)
    visible_bnqc = slot_1n1c <= jnp.tile(q_slot_bt, (1, g))[:, None, :, None]
    scores = jnp.where(visible_bnqc[:, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=(2, 4), keepdims=True)
    p = jnp.exp(scores - m)
    pv = jnp.einsum("bknqc,bkncd->bknqd", p.astype(v_bksh.dtype), v_bksh.reshape(b, kvh, nb, BLOCK, h),
                    preferred_element_type=F32)
    num = jnp.sum(pv, axis=2)  # over blocks (a non-minor axis: one sequential sum per output)
    den = jnp.sum(jnp.sum(p, axis=-1)[..., None], axis=2)
    return _heads_back(num / den, t, q_btnh.dtype)


def attention_rows(q_btnh: jax.Array, k_buf: jax.Array, v_buf: jax.Array, q_slot_bt: jax.Array,
                   k_scale: jax.Array | float = 1.0, v_scale: jax.Array | float = 1.0, *, scale: float) -> jax.Array:
    """cached_attention off the CPU: one softmax over the minor slot axis, the probabilities normalized and then
    cast to the compute dtype for the value product, as jax.nn.dot_product_attention's XLA path (the learner's)
    and HF's eager attention have it. XLA:GPU makes it 3 kernels (the score GEMM, one Triton softmax fusion, the
    value GEMM with the output's transpose), against 6 for the 64-slot blocks (`attention_blocks`), whose softmax
    over two axes it leaves as separate reductions (`python -m triage_jax.tools.gpu_aot decode`).

    An FP8 cache enters the GEMMs as its E4M3 values (exact in bf16) and its scales multiply the scores and the
    output: XLA:GPU fuses a bare convert into a GEMM's operand but not a convert times a scale, which made a bf16
    copy of both caches of a layer every step (2.5x the bytes a bf16 cache reads)."""
    t, s = q_btnh.shape[1], k_buf.shape[2]
    g = q_btnh.shape[2] // k_buf.shape[1]
    fp8 = k_buf.dtype == FP8
    k_bksh, v_bksh = k_buf.astype(q_btnh.dtype), v_buf.astype(q_btnh.dtype)
    q_bkqh = _queries_per_kv_head(q_btnh, k_buf.shape[1], q_btnh.dtype)
    score_scale = jnp.float32(scale) * jnp.float32(k_scale) if fp8 else scale
    scores_bkqs = jnp.einsum("bkqh,bksh->bkqs", q_bkqh, k_bksh, preferred_element_type=F32) * score_scale
    visible_bqs = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= jnp.tile(q_slot_bt, (1, g))[:, :, None]
    p_bkqs = jax.nn.softmax(jnp.where(visible_bqs[:, None], scores_bkqs, -jnp.inf), axis=-1)
    out_bkqh = jnp.einsum("bkqs,bksd->bkqd", p_bkqs.astype(v_bksh.dtype), v_bksh, preferred_element_type=F32)
    if fp8:
        out_bkqh = out_bkqh * jnp.float32(v_scale)
    return _heads_back(out_bkqh, t, q_btnh.dtype)


def attention_in_place(q_btnh: jax.Array, k_buf: jax.Array, v_buf: jax.Array, q_slot_bt: jax.Array,
                       k_scale: jax.Array | float = 1.0, v_scale: jax.Array | float = 1.0, *,
                       scale: float) -> jax.Array:
    """cached_attention off the CPU over a layer of a stacked cache, for a few queries a row (decode): both
    contractions as multiply-and-sum reductions, which XLA:GPU fuses with the layer's dynamic slice of the stacked
    [L, ...] buffer and so reads the layer's keys and values in place. Its GEMM fusions (`attention_rows`) take no
    slice: under a layer loop XLA copies the layer's keys and values out of the stack before them (4B, batch 64,
    capacity 512: 134 MB a layer, read and written; `python -m triage_jax.tools.gpu_aot decode --scan-layers`).

    Two things keep XLA from copying the cache anyway: both products are held to the row-major layout (XLA's
    layout assignment turns a reduction's operand to make it a row reduction: for the value sum it made the stacked
    cache slot-minor, a transposed copy of all of it around each round, at head dim 64 and at the 1.7B), and the
    probabilities pass an optimization barrier (else XLA's Triton softmax fusion takes the value sum in, and a copy
    of the values with it: an FP8 cache at the 4B). The softmax's sum is divided out after the value sum (as in
    `attention_blocks`) and the probabilities stay float32; an FP8 cache's values convert inside the reductions
    and its scales multiply the scores and the output, as in `attention_rows`. The sums run on CUDA cores, not
    tensor cores: meant for one new token a row, where reading the cache is the cost (a KV head's G queries read its
    keys G times, from the L2 when they run close together); a chunk of many new tokens keeps the GEMMs."""
    t, s = q_btnh.shape[1], k_buf.shape[2]
    g = q_btnh.shape[2] // k_buf.shape[1]
    fp8 = k_buf.dtype == FP8
    q_bkqh = _queries_per_kv_head(q_btnh, k_buf.shape[1], F32)
    score_scale = jnp.float32(scale) * jnp.float32(k_scale) if fp8 else jnp.float32(scale)
    scores_bkqs = jnp.sum(_row_major(q_bkqh[:, :, :, None, :] * k_buf.astype(F32)[:, :, None]), axis=-1)
    scores_bkqs = scores_bkqs * score_scale
    visible_bqs = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= jnp.tile(q_slot_bt, (1, g))[:, :, None]
    scores_bkqs = jnp.where(visible_bqs[:, None], scores_bkqs, -jnp.inf)
    p_bkqs = jnp.exp(scores_bkqs - jnp.max(scores_bkqs, axis=-1, keepdims=True))
    p_bkqs = jax.lax.optimization_barrier(p_bkqs)
    num_bkqh = jnp.sum(_row_major(p_bkqs[..., None] * v_buf.astype(F32)[:, :, None]), axis=-2)
    out_bkqh = num_bkqh / jnp.sum(p_bkqs, axis=-1)[..., None]
    if fp8:
        out_bkqh = out_bkqh * jnp.float32(v_scale)
    return _heads_back(out_bkqh, t, q_btnh.dtype)


def _row_major(x: jax.Array) -> jax.Array:
    """x with its layout held to the default row-major one (a constraint for XLA's layout assignment)."""
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def row_by_mask(s: jax.Array, i: jax.Array) -> jax.Array:
    """s[i][None] for s [R, ...] (a float or integer type of <= 4 bytes), as a sum over R of the rows masked to row i:
    one nonzero term, summed as unsigned integers (the bits, packed into uint32 words), so the result has s[i]'s
    exact bits (-0, NaN payloads, subnormals). For a row axis split over devices: each device sums its own rows
    and one all-reduce of a row follows, where XLA:GPU partitions jnp.take / dynamic_slice of a split axis as an
    all-gather of all of s (tools/dryrun.py --target=h200: an insertion held every layer's whole prefill cache on
    every device). A row index outside [0, R) gives zeros."""
    t = s if s.ndim > 1 else s[:, None]  # words along a row's last axis, never along the rows
    w = _to_words(t)
    hit = (jnp.arange(s.shape[0]) == i).reshape(-1, *([1] * (w.ndim - 1)))
    r = jnp.sum(jnp.where(hit, w, jnp.uint32(0)), axis=0, keepdims=True)
    return _from_words(r, s.dtype, t.shape[-1]).reshape(1, *s.shape[1:])


def _row_by_take(s: jax.Array, i: jax.Array) -> jax.Array:
    return jnp.take(s, i[None], axis=0)


def copy_rows(buf, src, slot_m: jax.Array, row_m: jax.Array, *, lead: int = 0):
    """Rows row_m of (prefill) cache buffers `src` into rows slot_m of the buffers `buf` at slots [0, P) (a slot
    index past a buffer's rows: dropped). buf / src: one buffer or matching pytrees of them, each [B, KVH, S, Dh]
    behind `lead` leading axes (a combined buffer's keys / values, a stack's layers).

    One loop over the entries for all the buffers, one row per step (a gather of it, a scatter of it), so the
    insertion holds one row of temporaries per buffer; a gather of all M rows at once held them all (M x the
    prompt's KV, replicated on every device under the mesh), and a loop per buffer made 36-72 loops of a 36-layer
    model (on an H200 each of 2 kernels outside any CUDA graph per entry: docs/architecture.md). Gather and scatter
    move the bits as unsigned integers when both buffers hold one 1- or 2-byte float type (see `scatter_set`: no
    float32 copy of the buffer on XLA:CPU). Where the active mesh splits the batch (the prompt rows), a row is
    fetched by `row_by_mask` (each device reads its own rows, then one all-reduce of the row), not by a gather that
    XLA:GPU would partition as an all-gather of every source buffer in every step."""
    bufs, tree = jax.tree.flatten(buf)
    srcs = jax.tree.leaves(src)
    p = srcs[0].shape[-2]
    pos_1p = jnp.arange(p, dtype=jnp.int32)[None, :]
    dts = [jnp.dtype(b.dtype) for b in bufs]
    views = [{1: jnp.uint8, 2: jnp.uint16}[dt.itemsize] if jnp.dtype(s.dtype) == dt and jnp.issubdtype(
        dt, jnp.floating) and dt.itemsize <= 2 else None for dt, s in zip(dts, srcs)]
    as_bits = lambda x, bits: x if bits is None else jax.lax.bitcast_convert_type(x, bits)  # noqa: E731
    srcs = [as_bits(s, bits) for s, bits in zip(srcs, views)]

    fetch = row_by_mask if batch_split() > 1 else _row_by_take

    def row(b, s, m):  # entry m into one [B, KVH, S, Dh] buffer
        r = fetch(s, row_m[m]).astype(b.dtype).transpose(0, 2, 1, 3)  # [1, P, KVH, Dh]
        return b.at[slot_m[m][None, None], :, pos_1p].set(r, mode="drop")

    for _ in range(lead):
        row = jax.vmap(row, in_axes=(0, 0, None))

    def one(m, bs):
        return tuple(row(b, s, m) for b, s in zip(bs, srcs))

    out = jax.lax.fori_loop(0, slot_m.shape[0], one, tuple(as_bits(b, bits) for b, bits in zip(bufs, views)))
    out = [o if bits is None else jax.lax.bitcast_convert_type(o, dt) for o, bits, dt in zip(out, views, dts)]
    return jax.tree.unflatten(tree, out)


def insert_rows(cache: KVCache, pre: KVCache, slot_m: jax.Array, row_m: jax.Array) -> KVCache:
    """`cache` with rows row_m of the prefill cache `pre` (this one's layout) copied into its rows slot_m, every
    layer's keys and values in one loop (`copy_rows`)."""
    lead = int(cache.combined) + int(cache.stacked)
    return cache.replace(kv=copy_rows(cache.kv, pre.kv, slot_m, row_m, lead=lead))
