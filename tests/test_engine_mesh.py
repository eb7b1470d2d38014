"""The engine on a data-parallel mesh of 8 simulated CPU devices: the same tokens and log-probs as on 1 device."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, sys, threading
    import jax, numpy as np
    from flax import nnx
    from jax import monitoring

    compiled = []  # the engine programs' compiles: (program, thread)
    monitoring.register_event_duration_secs_listener(
        lambda e, s, **kw: compiled.append((kw.get("fun_name"), threading.current_thread().name))
        if e.endswith("backend_compile_duration") and kw.get("fun_name") in (
            "jit(_prefill)", "jit(_insert)", "jit(_decode_round)") else None)
    from triage_jax import models, sampler, sharding as shd
    from triage_jax.sampler import Engine, EngineConfig, SamplingConfig

    mesh_shape, slots, precision = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    scan, kv_layout = sys.argv[5] == "scan", sys.argv[6]
    model = models.Qwen3(models.get_model_config("tiny", num_hidden_layers=2, num_key_value_heads=int(sys.argv[4]),
                                                 scan_layers=scan), rngs=nnx.Rngs(0))
    policy = None if precision == "none" else sampler.sampler_policy(precision)
    mesh = shd.make_mesh(mesh_shape)
    if policy is not None:  # the trainer's sync: weights quantized once, q / k / v merged unless the mesh splits them
        model = sampler.prepare_model(model, policy, mesh=mesh)
    cfg = SamplingConfig(max_new_tokens=24, stop_ids=(7, 11, 19))
    try:
        engine = Engine(cfg, EngineConfig(max_slots=slots, max_len=128, steps_per_round=4, kv_layout=kv_layout),
                        model=model, mesh=mesh, policy=policy)
    except ValueError as e:
        print("ERROR", e)
        sys.exit(0)
    prompts = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45], [77], [8, 9], [60, 61, 62], [1, 2, 3, 4, 5, 6, 7, 8]]
    out = engine.generate(prompts, jax.random.key(3), n=4)
    shards = {str(d) for d in engine.last_slot_devices}

    def shard_shape(x):
        x = getattr(getattr(x, "q", x), "packed", x)  # a QuantizedWeight's 4-bit codes [N, K / 2]
        return [list(x.shape), list(x.addressable_shards[0].data.shape)]

    attn = engine.state["layers"]["attn"] if scan else engine.state["layers"][0]["attn"]
    kv = engine.last_kv_sharding
    # A stacked cache: [layers, ...]; a combined one: [2 (keys, values), ...].
    kv_shape = ((2,) if scan else ()) + ((2,) if engine.kv_combined else ()) + (slots, int(sys.argv[4]), 64, 64)
    print("RESULT", json.dumps({
        "tokens": np.asarray(out.tokens).tolist(), "logp": np.asarray(out.logprobs).tolist(),
        "devices": len(jax.devices()), "slot_devices": len(shards),
        "q_proj": shard_shape(attn["q_proj"]["kernel"].get_value()) if "q_proj" in attn else None,  # else merged
        "o_proj": shard_shape(attn["o_proj"]["kernel"].get_value()),
        "embed": shard_shape(engine.state["embed"]["embedding"].get_value()),
        "kv_shard": list(kv.shard_shape(kv_shape)), "compiled": compiled, "slot_counts": engine.slot_counts}))
""")


def _run(mesh: dict, slots: int, devices: int, precision: str = "none", kv_heads: int = 2, scan: bool = False,
         kv_layout: str = "auto") -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(mesh), str(slots), precision, str(kv_heads),
                          "scan" if scan else "loop", kv_layout],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith(("RESULT ", "ERROR ")))
    if line.startswith("ERROR "):
        return {"error": line[len("ERROR "):]}
    return json.loads(line[len("RESULT "):])


def test_one_device_equals_8_data_parallel_devices():
    """8 slots on 1 device vs 64 slots over 8 devices (8 each): every request gets the same tokens although it
    lands in another slot on another device, and the mesh compacts its tail across devices (its output split over
    them: Engine._take_program). Its log-probs agree to float32 rounding: the partitioned program fuses elementwise
    ops differently (every stage of a layer matches bit for bit on its own), so the last bit of a log-prob can
    differ; on one device count they are bit-identical whatever the schedule (test_engine.py)."""
    one = _run({"data": 1}, 8, 1)
    eight = _run({"data": 8}, 64, 8)
    assert eight["devices"] == 8 and eight["slot_devices"] == 8  # the slots really are split
    assert min(eight["slot_counts"]) < 64  # the tail compacted on the mesh
    # The first round's programs compiled ahead on the engine's threads, for the arguments the mesh gives them:
    # the one prefill shape never again on the main thread, each program's first compile on a compile thread.
    compiled = [tuple(x) for x in eight["compiled"]]
    assert [t for p, t in compiled if p == "jit(_prefill)"] in (["engine-compile_0"], ["engine-compile_1"])
    for prog in ("jit(_prefill)", "jit(_insert)", "jit(_decode_round)"):
        assert next(t for p, t in compiled if p == prog).startswith("engine-compile"), compiled
    np.testing.assert_array_equal(np.asarray(one["tokens"]), np.asarray(eight["tokens"]))
    np.testing.assert_allclose(np.asarray(one["logp"], np.float32), np.asarray(eight["logp"], np.float32),
                               rtol=0, atol=4e-6)


@pytest.mark.slow  # ~65 s of compiles in two subprocesses; the default run keeps the data-parallel check above
def test_tensor_parallel_decode_equals_one_device():
    """W4A4 weights (quantized once, as the trainer syncs them) on a data=4 x tensor=2 mesh: the engine reshards
    them tensor-parallel (query/KV/gate/up codes split by output rows, o_proj/down_proj by input blocks, the
    embedding by vocabulary; nothing split over data), the KV cache by slots and KV heads, and every request
    gets the 1-device run's tokens, its log-probs within float32 rounding (the row-parallel sums add partial
    sums across devices)."""
    one = _run({"data": 1}, 4, 1, "w4a4")
    tp = _run({"data": 4, "tensor": 2}, 16, 8, "w4a4")
    assert tp["slot_devices"] == 8
    (n, k2), shard = tp["q_proj"]
    assert shard == [n // 2, k2]  # column-parallel: half the output rows, every input column
    (n, k2), shard = tp["o_proj"]
    assert shard == [n, k2 // 2]  # row-parallel: every output row, half the (packed) input
    (v, d), shard = tp["embed"]
    assert shard == [v // 2, d]
    assert tp["kv_shard"] == [16 // 4, 1, 64, 64]  # 4 slots and 1 of the 2 KV heads per device
    np.testing.assert_array_equal(np.asarray(one["tokens"]), np.asarray(tp["tokens"]))
    np.testing.assert_allclose(np.asarray(one["logp"], np.float32), np.asarray(tp["logp"], np.float32),
                               rtol=0, atol=4e-6)


@pytest.mark.slow  # a subprocess of compiles on 8 devices (~40 s on 2 cores) beside the 1-device run
def test_the_gpus_combined_kv_layout_on_a_tensor_parallel_mesh_equals_one_device():
    """The KV layout a GPU engine runs (kv_layout="combined", forced on the CPU: a layer's keys and values in one
    [2, slots, KV heads, S, Dh] buffer) on a data=4 x tensor=2 mesh: split by slots and KV heads, never across
    keys / values, and every request gets the 1-device run's tokens (the CPU's two buffers)."""
    one = _run({"data": 1}, 4, 1)
    tp = _run({"data": 4, "tensor": 2}, 16, 8, kv_layout="combined")
    assert tp["kv_shard"] == [2, 16 // 4, 1, 64, 64]
    np.testing.assert_array_equal(np.asarray(one["tokens"]), np.asarray(tp["tokens"]))
    np.testing.assert_allclose(np.asarray(one["logp"], np.float32), np.asarray(tp["logp"], np.float32),
                               rtol=0, atol=4e-6)


@pytest.mark.slow  # two subprocesses of compiles (~1 min on 2 cores)
def test_scanned_model_on_a_tensor_parallel_mesh_equals_one_device():
    """A scan_layers=True model decodes on a data=4 x tensor=2 mesh: its stacked KV cache [layers, slots, KV heads,
    S, Dh] is split by slots and KV heads (not by layers: the scan reads every layer on every device), its stacked
    weights column-parallel like the looped model's, and every request gets the 1-device run's tokens."""
    one = _run({"data": 1}, 4, 1, scan=True)
    tp = _run({"data": 4, "tensor": 2}, 16, 8, scan=True)
    assert tp["slot_devices"] == 8
    assert tp["kv_shard"] == [2, 16 // 4, 1, 64, 64]
    (layers, d, n, h), shard = tp["q_proj"]
    assert shard == [layers, d, n // 2, h]  # [layers, embed, heads, head_dim]: heads split, layers kept whole
    np.testing.assert_array_equal(np.asarray(one["tokens"]), np.asarray(tp["tokens"]))
    np.testing.assert_allclose(np.asarray(one["logp"], np.float32), np.asarray(tp["logp"], np.float32),
                               rtol=0, atol=4e-6)


def test_tensor_split_that_does_not_divide_the_kv_heads_names_the_config_key():
    out = _run({"data": 1, "tensor": 2}, 4, 2, "w4a4", kv_heads=1)
    assert "config.mesh.tensor" in out["error"] and "1 KV heads" in out["error"]


TRAINER_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from triage_jax.config import base_config
    from triage_jax.trainer import Trainer

    c = base_config()
    c.run_dir, c.warmup.enabled, c.train.progress = sys.argv[1], False, False
    c.mesh.data, c.mesh.tensor = int(sys.argv[2]), int(sys.argv[3])
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 4, 4, 16, 8
    c.rl.dynamic_sampling, c.rl.overlong_buffer = False, 8
    c.sampler.max_new_tokens, c.train.energy_every = 16, 0
    tr = Trainer(c)
    ro, stats, _ = tr.rollout(jax.random.fold_in(jax.random.key(c.seed), 0))
    m = tr.train_step().metrics
    attn = tr.engine.state["layers"][0]["attn"]
    name = "q_proj" if "q_proj" in attn else "qkv_proj"  # merged with k / v where the mesh does not split them
    w = attn[name]["kernel"].get_value()  # the synced W4A4 codes
    print("RESULT", json.dumps({"ids": ro.input_ids.tolist(), "rewards": ro.rewards.tolist(),
                                "lengths": ro.lengths.tolist(), "loss": m["learner/loss"],
                                "delta": m["mismatch/mean_abs_delta"], "reward": m["reward/mean"],
                                "q_name": name, "q_shard": list(w.q.packed.addressable_shards[0].data.shape),
                                "q_shape": list(w.q.packed.shape)}))
""")


@pytest.mark.slow  # three trainer start-ups in subprocesses: ~3 min on 2 cores
def test_trainer_on_8_devices_rolls_out_what_1_device_does(tmp_path):
    """The trainer on --config.mesh.data=8 (8 simulated devices) and on data=2 x tensor=2 (4 devices, the synced
    W4A4 weights split over tensor): its first rollout is the 1-device run's exactly (tokens, rewards, lengths),
    and the step's learner metrics agree to float reduction order. The learner computes in bf16: the row-parallel
    layers add their f32 partial sums in another order, which now and then flips a bf16 rounding of an activation,
    so mean |delta| (a mean of log-prob differences) agrees to bf16 precision (2^-8), the loss to f32's."""
    def run(data, tensor, devices):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", TRAINER_SCRIPT, str(tmp_path / f"run{data}x{tensor}"), str(data),
                              str(tensor)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])

    one, tp = run(1, 1, 1), run(2, 2, 4)
    for other in (run(8, 1, 8), tp):
        for k in ("ids", "rewards", "lengths"):
            np.testing.assert_array_equal(np.asarray(one[k]), np.asarray(other[k]), err_msg=k)
        assert one["reward"] == other["reward"]
        np.testing.assert_allclose(one["loss"], other["loss"], rtol=1e-4, atol=1e-6, err_msg="loss")
        np.testing.assert_allclose(one["delta"], other["delta"], rtol=2.0 ** -8, err_msg="delta")
    assert tp["q_name"] == "q_proj" and tp["q_shard"] == [tp["q_shape"][0] // 2, tp["q_shape"][1]]  # split
    assert one["q_name"] == "qkv_proj" and one["q_shard"] == one["q_shape"]  # one device: q / k / v merged
