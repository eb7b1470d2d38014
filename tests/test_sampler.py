"""The jitted sampler on the tiny Qwen3: exactness against teacher forcing, seeds, filters, stops, low precision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triage_jax import sampler as smp
from triage_jax.logprobs import default_positions, response_logprobs
from triage_jax.models import Qwen3, get_model_config
from triage_jax.quant import PrecisionPolicy
from triage_jax.sampler import SamplingConfig, filter_logits, generate, prepare_model, sampler_policy

PAD = 0
# Different lengths, so rows are left-padded by different amounts.
PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [77]]
F32_POLICY = PrecisionPolicy()


@pytest.fixture(scope="module")
def model():
    return Qwen3(get_model_config("tiny", num_hidden_layers=2), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model_bf16():
    return Qwen3(get_model_config("tiny", num_hidden_layers=2, dtype="bfloat16"), rngs=nnx.Rngs(0))


def _learner(model, out, policy=F32_POLICY, temperature=1.0):
    """The learner's log-probs of the response, jitted as the learner runs them."""
    return nnx.jit(lambda m, *a: response_logprobs(m, *a, policy=policy, temperature=temperature, vocab_chunk=48))(
        model, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)


@nnx.jit
def _forward(model, seq, real):
    return model(seq, default_positions(real), real)


def _teacher_forced_logits(model, out):
    """Logits [B, N, V] predicting each response token, from one forward pass over prompt ++ response."""
    seq = jnp.concatenate([out.prompt_tokens, out.tokens], axis=1)
    real = jnp.concatenate([out.prompt_mask, out.mask], axis=1)
    p = out.prompt_tokens.shape[1]
    return _forward(model, seq, real)[:, p - 1:-1]


def test_greedy_equals_teacher_forced_argmax_and_logprobs_match(model):
    cfg = SamplingConfig(max_new_tokens=10, greedy=True)
    out = generate(model, PROMPTS, cfg, policy=F32_POLICY, key=jax.random.key(0), pad_id=PAD)
    assert out.tokens.shape == (3, 10) and out.mask.all() and (out.lengths == 10).all()
    np.testing.assert_array_equal(out.prompt_lengths, [4, 11, 1])
    logits = _teacher_forced_logits(model, out)
    np.testing.assert_array_equal(out.tokens, jnp.argmax(logits, -1))
    np.testing.assert_allclose(out.logprobs, _learner(model, out), atol=1e-5)
    # Row-independence: a prompt decoded alone (no padding) gives the same greedy continuation.
    alone = generate(model, [PROMPTS[2]], cfg, policy=F32_POLICY, key=jax.random.key(0), pad_id=PAD)
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[2])


def test_sampled_logprobs_equal_learner_logprobs(model):
    temperature, top_p, top_k = 0.7, 0.95, 20
    cfg = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k)
    out = generate(model, PROMPTS, cfg, policy=F32_POLICY, key=jax.random.key(1), pad_id=PAD)
    # Full-vocabulary log-probs at the sampling temperature, before the top-p / top-k truncation.
    np.testing.assert_allclose(out.logprobs, _learner(model, out, temperature=temperature), atol=1e-5)
    logits = _teacher_forced_logits(model, out)
    rank = jnp.sum(logits > jnp.take_along_axis(logits, out.tokens[..., None], -1), axis=-1)
    assert int(rank.max()) < top_k  # every drawn token is among the top-k
    assert float(jnp.exp(out.logprobs).min()) < 0.5  # and it really sampled (not a near-greedy draw)


def test_moe_model_logprobs_equal_learner_logprobs():
    moe = Qwen3(get_model_config("tiny_moe", num_hidden_layers=1), rngs=nnx.Rngs(0))
    out = generate(moe, PROMPTS, SamplingConfig(max_new_tokens=8, temperature=0.8), key=jax.random.key(0),
                   pad_id=PAD)
    np.testing.assert_allclose(out.logprobs, _learner(moe, out, temperature=0.8), atol=1e-5)


def test_seeds(model):
    cfg = SamplingConfig(max_new_tokens=16)
    a = generate(model, PROMPTS, cfg, key=jax.random.key(7), pad_id=PAD)
    b = generate(model, PROMPTS, cfg, key=jax.random.key(7), pad_id=PAD)
    c = generate(model, PROMPTS, cfg, key=jax.random.key(8), pad_id=PAD)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)


def test_top_k_1_equals_greedy(model):
    greedy = generate(model, PROMPTS, SamplingConfig(max_new_tokens=8, greedy=True), key=jax.random.key(0),
                      pad_id=PAD)
    top1 = generate(model, PROMPTS, SamplingConfig(max_new_tokens=8, top_k=1, temperature=1.5),
                    key=jax.random.key(3), pad_id=PAD)
    np.testing.assert_array_equal(greedy.tokens, top1.tokens)


def _kept(logits, **kw):
    return set(np.flatnonzero(np.isfinite(np.asarray(filter_logits(jnp.asarray(logits)[None], **kw)[0]))).tolist())


def test_filter_logits_on_a_hand_made_distribution():
    probs = np.array([0.1, 0.5, 0.05, 0.2, 0.15])  # sorted: idx 1 (.5), 3 (.2), 4 (.15), 0 (.1), 2 (.05)
    logits = np.log(probs)
    assert _kept(logits) == {0, 1, 2, 3, 4}
    assert _kept(logits, top_p=0.5) == {1}  # the mass before idx 3 is 0.5, not < 0.5
    assert _kept(logits, top_p=0.6) == {1, 3}
    assert _kept(logits, top_p=0.8) == {1, 3, 4}  # mass before idx 4 = 0.7 < 0.8; before idx 0 = 0.85
    assert _kept(logits, top_p=0.01) == {1}  # the top token is always kept
    assert _kept(logits, top_p=1.0) == {0, 1, 2, 3, 4}
    assert _kept(logits, top_k=2) == {1, 3}
    assert _kept(logits, top_k=10) == {0, 1, 2, 3, 4}
    # top-p applies to the top-k-renormalized distribution: .5/.85, .2/.85 already reach 0.8.
    assert _kept(logits, top_k=3, top_p=0.8) == {1, 3}
    # kept logits are unchanged
    out = np.asarray(filter_logits(jnp.asarray(logits)[None], top_p=0.6)[0])
    np.testing.assert_array_equal(out[[1, 3]], logits[[1, 3]].astype(np.float32))


def test_filtered_sampling_frequencies():
    logits = jnp.log(jnp.array([[0.1, 0.5, 0.05, 0.2, 0.15]]))
    draws = jax.vmap(lambda k: jax.random.categorical(k, filter_logits(logits, top_p=0.6)[0]))(
        jax.random.split(jax.random.key(0), 4000))
    counts = np.bincount(np.asarray(draws), minlength=5) / 4000
    np.testing.assert_allclose(counts, [0, 0.5 / 0.7, 0, 0.2 / 0.7, 0], atol=0.03)


def test_stop_tokens_end_rows_and_mask_the_rest(model):
    cfg = SamplingConfig(max_new_tokens=12, greedy=True)
    free = np.asarray(generate(model, PROMPTS, cfg, key=jax.random.key(0), pad_id=PAD).tokens)
    stops = (int(free[0, 3]), int(free[1, 5]), int(free[2, 7]))
    stopped = generate(model, PROMPTS, SamplingConfig(max_new_tokens=12, greedy=True, stop_ids=stops),
                       key=jax.random.key(0), pad_id=PAD)
    toks, mask = np.asarray(stopped.tokens), np.asarray(stopped.mask)
    for b in range(3):
        n = np.flatnonzero(np.isin(free[b], stops))[0] + 1
        assert stopped.lengths[b] == n and mask[b].sum() == n and mask[b, :n].all()
        np.testing.assert_array_equal(toks[b, :n], free[b, :n])  # the stop token is kept
        assert (toks[b, n:] == PAD).all() and (np.asarray(stopped.logprobs)[b, n:] == 0).all()
    assert stopped.lengths[0] <= 4 and stopped.lengths[1] <= 6 and stopped.lengths[2] <= 8
    # The loop exits as soon as every row has stopped.
    assert int(stopped.steps) == int(stopped.lengths.max()) <= 8
    np.testing.assert_allclose(stopped.logprobs, _learner(model, stopped), atol=1e-5)


def test_w4a4_sampler_differs_from_bf16_learner(model_bf16):
    policy = sampler_policy("w4a4")
    assert policy.for_layer("layers.0.mlp.up_proj").act_scaling == "row"
    sampler_model = prepare_model(model_bf16, policy)
    cfg = SamplingConfig(max_new_tokens=12)
    out = generate(sampler_model, PROMPTS, cfg, policy=policy, key=jax.random.key(0), pad_id=PAD)
    assert np.all(np.isfinite(out.logprobs)) and np.all(np.asarray(out.logprobs) <= 0)
    learner = _learner(model_bf16, out, policy=PrecisionPolicy.from_spec("bf16"))
    delta = np.abs(np.asarray(learner - out.logprobs))[np.asarray(out.mask)]
    assert delta.mean() > 1e-3


def test_per_tensor_activation_scales_couple_a_response_to_its_batch(model_bf16):
    """act_scaling="tensor" (config.sampler.act_scaling, a mismatch dial) shares each matmul input's float32 scale
    over the batch: a prompt's first log-prob then depends on the prompts batched with it; token-wise scales
    ("row", the default) keep it the prompt's own."""
    cfg = SamplingConfig(max_new_tokens=1, greedy=True)
    first = {}
    for scaling in ("row", "tensor"):
        policy = sampler_policy("w4a4", act_scaling=scaling)
        m = prepare_model(model_bf16, policy)
        batched = generate(m, PROMPTS, cfg, policy=policy, key=jax.random.key(0), pad_id=PAD)
        alone = generate(m, [PROMPTS[1]], cfg, policy=policy, key=jax.random.key(0), pad_id=PAD)
        first[scaling] = float(batched.logprobs[1, 0]), float(alone.logprobs[0, 0])
    assert first["row"][0] == first["row"][1]
    assert first["tensor"][0] != first["tensor"][1]


def test_fp8_kv_cache(model):
    cfg = SamplingConfig(max_new_tokens=10, greedy=True)
    policy = sampler_policy("bf16", kv_cache="fp8")
    out = generate(model, PROMPTS, cfg, policy=policy, key=jax.random.key(0), pad_id=PAD)
    assert np.all(np.isfinite(out.logprobs))
    delta = np.abs(np.asarray(_learner(model, out) - out.logprobs))
    assert 0 < delta.mean() < 0.5  # FP8 keys/values: a small, nonzero mismatch


def test_too_long_prompt_is_a_clear_error(model):
    cfg = SamplingConfig(max_new_tokens=8)
    with pytest.raises(ValueError, match=r"11 tokens.*max_new_tokens=8.*needs 19 .*max_cache_len=16"):
        generate(model, PROMPTS, cfg, key=jax.random.key(0), pad_id=PAD, max_cache_len=16)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []], cfg, key=jax.random.key(0), pad_id=PAD)
    with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
        generate(model, [[1, 200]], cfg, key=jax.random.key(0), pad_id=PAD)


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    assert SamplingConfig(max_new_tokens=4, stop_ids=[1, 2]).stop_ids == (1, 2)


def test_length_buckets_reuse_compiled_programs(model):
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.9)
    gd, state = nnx.split(model)
    generate((gd, state), [[1, 2, 3], [4, 5]], cfg, key=jax.random.key(0), pad_id=PAD)
    sizes = [f._cache_size() for f in (smp._prefill, smp._insert, smp._decode_round)]
    # Other prompt lengths in the same bucket, another temperature and other stop ids: no new compilation.
    generate((gd, state), [[1, 2, 3, 4, 5, 6, 7], [9]], SamplingConfig(max_new_tokens=6, temperature=0.5,
                                                                       stop_ids=(3,)),
             key=jax.random.key(1), pad_id=PAD)
    assert [f._cache_size() for f in (smp._prefill, smp._insert, smp._decode_round)] == sizes
    assert smp.bucket_length(3) == 64 and smp.bucket_length(65) == 128 and smp.bucket_length(64) == 64


def test_xla_options_reach_the_engine_programs_and_keep_the_tokens(model, tmp_path):
    """EngineConfig.xla_options compile the engine's programs with those options (here `xla_dump_to`, whose dumps
    show that the decode round was compiled with them) and leave the numbers alone (a GPU option, which a CPU
    ignores); a misspelt option fails at construction, naming the option."""
    from triage_jax.sampler import Engine, EngineConfig

    cfg = SamplingConfig(max_new_tokens=5, greedy=True)
    opts = (("xla_dump_to", str(tmp_path)), ("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,WHILE,CONDITIONAL"))

    def run(xla_options):
        eng = Engine(cfg, EngineConfig(max_slots=4, max_len=32, xla_options=xla_options), model=model, pad_id=PAD)
        return eng.generate(PROMPTS, jax.random.key(0))

    plain, tuned = run(()), run(opts)
    np.testing.assert_array_equal(np.asarray(tuned.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(tuned.logprobs), np.asarray(plain.logprobs))
    dumped = " ".join(p.name for p in tmp_path.iterdir())
    assert "_decode_round" in dumped and "_prefill" in dumped and "_insert" in dumped
    with pytest.raises(ValueError, match="xla_gpu_enable_comand_buffer"):
        EngineConfig(max_slots=4, max_len=32, xla_options=(("xla_gpu_enable_comand_buffer", "FUSION"),))
    with pytest.raises(ValueError, match="not a .name, value. pair"):
        EngineConfig(max_slots=4, max_len=32, xla_options=("xla_dump_to=/tmp",))
