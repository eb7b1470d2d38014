"""MoE expert parallelism on 8 simulated CPU devices equals the single-device layer (values and gradients)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from triage_jax import sharding as shd
    from triage_jax.models import get_model_config
    from triage_jax.models import moe as moe_lib

    mesh_shape, dtype = json.loads(sys.argv[1]), sys.argv[2]
    cfg = get_model_config("tiny_moe", hidden_size=32, moe_intermediate_size=16, num_experts=8,
                           num_experts_per_tok=3, initializer_range=0.2, dtype=dtype)
    layer = moe_lib.MoE(cfg, 0, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (8, 6, 32)).astype(dtype)
    mask = jnp.asarray(np.arange(6)[None, :] < np.asarray([6, 5, 4, 6, 2, 6, 6, 3])[:, None])

    def loss(p, x):
        y, st = nnx.merge(graphdef, p)(x, mask_bt=mask)
        aux = moe_lib.load_balancing_loss([st], cfg.num_experts)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux, (y, aux)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    used = False
    if mesh_shape:
        mesh = shd.make_mesh(mesh_shape)
        params = jax.device_put(params, shd.state_shardings(params, mesh))
        x = jax.device_put(x, shd.batch_sharding(mesh, 3))
        with jax.set_mesh(mesh):
            used = moe_lib.expert_mesh(cfg.num_experts) is not None
            text = step.lower(params, x).as_text()
            (l, (y, aux)), (gp, gx) = step(params, x)
        assert ("all-gather" in text or "all_gather" in text) and "reduce_scatter" in text.replace("-", "_"), \\
            "expert-parallel path did not dispatch over the expert axis"
    else:
        (l, (y, aux)), (gp, gx) = step(params, x)
    flat = {"/".join(map(str, k)): np.asarray(v, np.float32).tolist() for k, v in nnx.to_flat_state(gp)}
    print("RESULT", json.dumps({"y": np.asarray(y, np.float32).tolist(), "aux": float(aux),
                                "gx": np.asarray(gx, np.float32).tolist(), "gp": flat, "ep": used}))
""")


def _run(mesh: dict, dtype: str = "float32") -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(mesh), dtype], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def single():
    return _run({})


@pytest.mark.parametrize("mesh", [{"expert": 8}, {"fsdp": 2, "tensor": 1, "expert": 4},
                                  {"data": 2, "tensor": 2, "expert": 2}])
def test_expert_parallel_moe_equals_single_device(single, mesh):
    ep = _run(mesh)
    assert ep["ep"] and not single["ep"]
    np.testing.assert_allclose(ep["y"], single["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ep["aux"], single["aux"], rtol=1e-6)
    np.testing.assert_allclose(ep["gx"], single["gx"], rtol=1e-4, atol=1e-5)
    assert ep["gp"].keys() == single["gp"].keys()
    for k in single["gp"]:
        np.testing.assert_allclose(ep["gp"][k], single["gp"][k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_expert_parallel_rejects_indivisible_expert_count():
    script = textwrap.dedent("""
        import jax
        from triage_jax import sharding as shd
        from triage_jax.models import moe
        with jax.set_mesh(shd.make_mesh({"expert": 8})):
            moe.expert_mesh(6)
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "num_experts=6 is not divisible by the mesh's expert axis (8)" in out.stderr


@pytest.mark.parametrize("rows", [1, 7, 16, 1000])
def test_row_chunked_expert_ffn_equals_one_call(rows):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from triage_jax.models import get_model_config
    from triage_jax.models import moe as moe_lib

    cfg = get_model_config("tiny_moe", hidden_size=32, moe_intermediate_size=16, num_experts=6,
                           num_experts_per_tok=2, initializer_range=0.2)
    layer = moe_lib.MoE(cfg, 0, rngs=nnx.Rngs(4))
    x = jax.random.normal(jax.random.key(5), (3, 9, 32))

    def loss(m, x):
        y, _ = m(x)
        return jnp.sum(jnp.sin(y)), y

    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    ref = step(layer, x)
    chunked = nnx.merge(nnx.graphdef(moe_lib.MoE(cfg.replace(moe_row_chunk=rows), 0, rngs=nnx.Rngs(0))),
                        nnx.state(layer))
    assert chunked.row_chunk == rows
    got = step(chunked, x)  # the same jitted function: the chunk is static, so this is a new trace
    np.testing.assert_allclose(got[0][1], ref[0][1], rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(got[1][0], nnx.Param)),
                    jax.tree.leaves(nnx.state(ref[1][0], nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # weight grads summed over blocks
    np.testing.assert_allclose(got[1][1], ref[1][1], rtol=1e-4, atol=1e-5)


def test_row_chunk_change_reaches_the_next_jitted_call():
    """ModelConfig.moe_row_chunk is static (part of the module's graphdef, hence of the jit key): a jitted function
    traced once without chunking runs the chunked program when called on the chunked layer. With a per-tensor NVFP4
    activation scale the chunks take their own scales, so the two programs give different outputs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from triage_jax.models import get_model_config
    from triage_jax.models import moe as moe_lib
    from triage_jax.quant import PrecisionPolicy

    cfg = get_model_config("tiny_moe", hidden_size=32, moe_intermediate_size=16, num_experts=6,
                           num_experts_per_tok=2, initializer_range=0.2)
    policy = PrecisionPolicy.from_spec("w4a4", debug_nonfinite=False)
    layer = moe_lib.MoE(cfg, 0, rngs=nnx.Rngs(4))
    x = jax.random.normal(jax.random.key(5), (3, 9, 32)) * jnp.exp(jax.random.normal(jax.random.key(6), (3, 9, 1)))
    f = nnx.jit(lambda m, x: m(x, policy)[0])
    y_one = np.asarray(f(layer, x))
    chunked = nnx.merge(nnx.graphdef(moe_lib.MoE(cfg.replace(moe_row_chunk=7), 0, rngs=nnx.Rngs(0))),
                        nnx.state(layer))
    y_chunked = np.asarray(f(chunked, x))
    np.testing.assert_allclose(y_one, np.asarray(layer(x, policy)[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y_chunked, np.asarray(chunked(x, policy)[0]), rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(y_chunked - y_one)) > 1e-3 * np.max(np.abs(y_one))
    np.testing.assert_array_equal(np.asarray(f(layer, x)), y_one)  # and back


LEARNER_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from triage_jax import build, models
    from triage_jax.config import base_config

    mesh = json.loads(sys.argv[1])
    c = base_config()
    c.rl.num_prompts, c.rl.group_size, c.rl.mini_batch, c.rl.micro_batch = 2, 4, 8, 8
    for k, v in mesh.items():
        c.mesh[k] = v
    c.optim.warmup_steps = 1
    mc = models.get_model_config("tiny_moe", vocab_size=128, num_hidden_layers=2, num_experts=8)
    learner = build.learner(c, models.Qwen3(mc, rngs=nnx.Rngs(0)))
    from triage_jax import sharding as shd
    from triage_jax.models import moe
    with shd.activate(learner.mesh, learner.rules):  # what the Learner traces under
        assert (moe.expert_mesh(8) is not None) == (mesh.get("expert", 1) > 1)
    rng = np.random.default_rng(0)
    n, p, r = 8, 6, 6
    ids = rng.integers(2, 100, (n, p + r)).astype(np.int32)
    attn = np.ones((n, p + r), bool); attn[:4, :2] = False
    resp = np.ones((n, r), np.float32); resp[::3, 4:] = 0
    adv = rng.normal(size=n).astype(np.float32)
    old, _ = learner.logprobs(ids, attn, r)
    batch, _, _ = learner.prepare(input_ids=ids, attn_mask=attn, resp_mask=resp, adv=adv, sampler_logp=old,
                                  old_logp=old, ref_logp=jnp.zeros_like(old))
    out = learner.update(batch)
    new, _ = learner.logprobs(ids, attn, r)
    print("RESULT", json.dumps({"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
                                "aux": float(out["moe_aux_loss"]), "old": np.asarray(old).tolist(),
                                "new": np.asarray(new).tolist()}))
""")


@pytest.mark.slow  # 57 s on 2 cores (pytest -n 2): the default run stays near 15 min
def test_moe_learner_step_with_expert_parallelism_equals_single_device():
    """The whole learner (recompute, loss with the aux term, update) on fsdp=2 x expert=4 equals one device."""

    def run(mesh):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", LEARNER_SCRIPT, json.dumps(mesh)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT "))[7:])

    single, ep = run({}), run({"fsdp": 2, "expert": 4})
    for k in ("loss", "grad_norm", "aux"):
        np.testing.assert_allclose(ep[k], single[k], rtol=2e-4, err_msg=k)
    np.testing.assert_allclose(ep["old"], single["old"], atol=2e-5)
    np.testing.assert_allclose(ep["new"], single["new"], atol=2e-5)
    assert np.abs(np.asarray(single["new"]) - np.asarray(single["old"])).max() > 1e-4  # the update moved it
