"""experiments/bench_gpu.py off a GPU (`--small`): the parts that decide what a scarce GPU run brings back."""

import pytest

from experiments import bench_gpu as bg


def test_a_failing_variant_is_an_error_row_and_the_run_goes_on(monkeypatch, capsys):
    """One layout that does not build or compile (here an unknown preset) must not cost the other rows: the GPU
    minutes are few. Its row carries the error; the best layout and the targets count only the rows that ran."""
    monkeypatch.setattr(bg, "VARIANTS", ("bf16", "nope_x", "w4a16"))
    monkeypatch.setitem(bg.LAYOUT_BACKENDS, "x", "xla")
    res = bg.main(["--small", "--parts", "gemm"])
    rows = {(r["m"], r["variant"]): r for r in res["gemm"]}
    assert len(rows) == 6 and all("error" in rows[(m, "nope_x")] for m in (1, 16))
    assert all(rows[(m, v)]["speedup_vs_bf16"] > 0 for m in (1, 16) for v in ("bf16", "w4a16"))
    assert res["gemm_best"]["w4a16_m1_16"][1] == "w4a16" and res["gemm_best"]["w4a4_m1_16"] == (None, None)
    assert res["gemm_targets"]["w4a4_2x_at_m_le_16"] is None  # no w4a4 row ran: no verdict, not a failure
    assert "FAILED" in capsys.readouterr().out


def test_step_ops_counts_the_kernels_of_one_loop_iteration():
    """The engine table's ops/step: the work instructions of one iteration of the named loop in optimized HLO, a
    nested loop's body counted its known trip count times (the sort here runs 3 times per outer iteration), tuple
    plumbing not at all; a loop that is not there is an error naming it."""
    import jax
    import jax.numpy as jnp
    import pytest

    def f(x):
        def body(c):
            i, y = c
            y = jax.lax.fori_loop(0, 3, lambda j, z: jnp.sort(z * 1.5) + 1.0, y)
            return i + 1, jnp.cumsum(y) * 0.5
        return jax.lax.while_loop(lambda c: c[1].sum() < 100.0, body, (0, x))

    hlo = jax.jit(f).lower(jnp.arange(8.0)).compile().as_text()
    ops = bg.step_ops(hlo, loop="jit(f)/while")
    assert ops["sort"] == 3 and ops.get("fusion", 0) >= 3
    assert not {"parameter", "tuple", "get-tuple-element", "constant"} & set(ops)
    with pytest.raises(ValueError, match="no while loop named 'jit\\(g\\)/while'"):
        bg.step_ops(hlo, loop="jit(g)/while")


@pytest.mark.slow  # 56 s on 2 cores (pytest -n 2): the default run stays near 15 min; CI runs it
def test_engine_hf_and_first_call_run_in_the_dry_run():
    """The engine table's HF `generate` row (torch on the CPU here, the GPU there) and the first call's fresh
    processes (an empty, then a filled compilation cache) run off a GPU too, so a transformers / torch API change
    or a broken first-call script shows here, not in the GPU's minutes."""
    res = bg.main(["--small", "--parts", "engine,first_call", "--samplers", "bf16",
                   "--first_call_samplers", "bf16,w4a4"])
    rows = {r["sampler"]: r for r in res["engine"]}
    assert set(rows) == {"bf16", "hf"} and "error" not in rows["hf"], rows
    assert rows["hf"]["decode_tok_s"] > 0 and rows["hf"]["vs_bf16"] > 0
    fc = res["first_call"]
    assert fc["cold_s"] > 0 and fc["cached_s"] > 0, fc
    assert fc["w4a4_cold_s"] > 0 and fc["w4a4_cached_s"] > 0, fc  # the main config's sampler
