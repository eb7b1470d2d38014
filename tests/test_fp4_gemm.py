"""The Mosaic GPU 4-bit weight GEMM (kernels/fp4_gemm.py): its numerics in Mosaic GPU's CPU interpreter, its
lowering for CUDA (jax.export on the CPU), and on a GPU (-m gpu) the compiled kernel against the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from triage_jax.kernels import fp4_gemm as fg
from triage_jax.quant import formats as fmt


def _weight(n, k, fmt_name, seed=0):
    w = jax.random.normal(jax.random.key(seed), (n, k)) * 0.05
    w = w.at[3, 5].set(40.0)  # one outlier block: scales across the range
    return fmt.quantize_nvfp4(w) if fmt_name == "nvfp4" else fmt.quantize_mxfp4(w)


def _x(m, k, seed=1):
    return jax.random.normal(jax.random.key(seed), (m, k)).astype(jnp.bfloat16)


def _check(got, x, q):
    ref, bound = fg.reference(x, q), fg.accumulation_bound(x, q)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    err = np.abs(np.asarray(got) - np.asarray(ref))
    assert np.all(err <= np.asarray(bound)), f"max error {err.max()} over the bound {float(bound.max())}"


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,split_k", [(1, 1), (20, 2), (64, None)])
def test_fp4_matmul_equals_the_reference_within_accumulation_order(fmt_name, m, split_k):
    """Decode-sized M (padded to 16), split-K (partial sums added after the kernel) or not, both scale formats."""
    q = _weight(128, 256, fmt_name)
    x = _x(m, 256)
    _check(fg.fp4_matmul(x, fg.prepare_weight(q), split_k=split_k, chunks_per_step=2), x, q)


def test_fp4_matmul_several_row_tiles():
    """M = 272: two 256-row tiles of x^T, the second padded."""
    q = _weight(64, 64, "nvfp4", seed=2)
    x = _x(272, 64, seed=3)
    _check(fg.fp4_matmul(x, fg.prepare_weight(q)), x, q)


def test_weight_layout_holds_each_block_in_one_nibble_plane():
    """codes[c, n, j]: low nibble W[n, 32c + j], high nibble W[n, 32c + 16 + j]; scales K-major."""
    q = _weight(64, 96, "nvfp4", seed=4)
    pw = fg.prepare_weight(q)
    c = np.asarray(pw.codes)
    planes = np.stack([c & 0xF, c >> 4], axis=2)  # [K/32, N, 2, 16]
    np.testing.assert_array_equal(planes.transpose(1, 0, 2, 3).reshape(64, 96), np.asarray(q.codes))
    np.testing.assert_array_equal(np.asarray(pw.scales).T, np.asarray(jax.lax.bitcast_convert_type(q.scale, jnp.uint8)))
    assert pw.shape == (64, 96) and float(pw.factor) == float(q.global_decode_scale())


def test_bad_inputs_are_named():
    q = _weight(64, 64, "nvfp4")
    with pytest.raises(ValueError, match="N % 64"):
        fg.prepare_weight(fmt.quantize_nvfp4(jnp.ones((48, 64))))
    with pytest.raises(ValueError, match="tensor scaling"):
        fg.prepare_weight(fmt.quantize_nvfp4(jnp.ones((64, 64)), scaling="row"))
    with pytest.raises(ValueError, match=r"x\[M, 64\]"):
        fg.fp4_matmul(_x(4, 32), fg.prepare_weight(q))
    with pytest.raises(ValueError, match="split_k=3"):
        fg.fp4_matmul(_x(4, 64), fg.prepare_weight(q), split_k=3, chunks_per_step=1)


@pytest.mark.parametrize("k,n", [(2560, 9728), (9728, 2560)])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_fp4_matmul_lowers_for_cuda_at_qwen3_4b_shapes(k, n, m):
    """The CPU-side guard of the GPU lowering (Mosaic GPU's TMA, wgmma, register layouts and shared-memory budget
    are all checked when it lowers). The PTX compile itself is test_fp4_matmul_compiled_on_gpu's."""
    pw = jax.eval_shape(lambda: fg.prepare_weight(fmt.quantize_nvfp4(jnp.zeros((n, k)))))
    fn = jax.jit(lambda x, w: fg.fp4_matmul(x, w, interpret=False))
    export.export(fn, platforms=["cuda"])(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), pw)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_fp4_matmul_compiled_on_gpu(fmt_name):
    for (k, n) in ((2560, 9728), (9728, 2560)):
        q = _weight(n, k, fmt_name, seed=k)
        pw = fg.prepare_weight(q)
        for m in (1, 16, 64, 256, 300):
            x = _x(m, k, seed=m)
            _check(fg.fp4_matmul(x, pw, interpret=False), x, q)
