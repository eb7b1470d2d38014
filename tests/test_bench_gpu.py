"""experiments/bench_gpu.py off a GPU (`--small`): the parts that decide what a scarce GPU run brings back."""

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
