"""The rollout engine: continuous batching, shared prompts, capacity buckets, determinism under any schedule."""

import contextlib
import threading

import jax
import numpy as np
import pytest
from flax import nnx
from jax import monitoring

from triage_jax.logprobs import response_logprobs
from triage_jax.models import Qwen3, get_model_config
from triage_jax.sampler import Engine, EngineConfig, SamplingConfig, generate

PAD = 0
PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [77], [8, 9], [60, 61, 62]]
# A common token as a stop token: responses end at very different lengths (a skewed workload).
CFG = SamplingConfig(max_new_tokens=40, stop_ids=(7, 11, 19, 23))


@pytest.fixture(scope="module")
def model():
    return Qwen3(get_model_config("tiny", num_hidden_layers=2), rngs=nnx.Rngs(0))


def run(model, *, slots, continuous=True, steps=4, n=3, prompts=PROMPTS, key=0, max_len=128, prefill_batch=8,
        max_prompt_len=0, compact_tail=4, round_loop="auto", kv_layout="auto", policy=None, cfg=CFG):
    engine = Engine(cfg, EngineConfig(max_slots=slots, max_len=max_len, steps_per_round=steps,
                                      prefill_batch=prefill_batch, continuous=continuous,
                                      max_prompt_len=max_prompt_len, compact_tail=compact_tail,
                                      round_loop=round_loop, kv_layout=kv_layout),
                    pad_id=PAD, model=model, policy=policy)
    return engine, engine.generate(prompts, jax.random.key(key), n=n)


def as_np(out):
    return {k: np.asarray(getattr(out, k)) for k in ("tokens", "logprobs", "mask", "lengths")}


def test_schedule_never_changes_a_request(model):
    """Continuous batching in 4 slots, static waves of 4, one static batch of all 15 requests, other round sizes
    and prefill batches: identical tokens and log-probs for every request (keys follow request ids, not slots)."""
    _, ref = run(model, slots=15, continuous=False)
    lengths = np.asarray(ref.lengths)
    assert lengths.min() < 10 and lengths.max() >= 20  # the stops make the lengths skewed
    for kw in (dict(slots=4), dict(slots=4, continuous=False), dict(slots=5, steps=1), dict(slots=3, steps=7),
               dict(slots=4, prefill_batch=2)):
        _, out = run(model, **kw)
        for k, v in as_np(out).items():
            np.testing.assert_array_equal(v, as_np(ref)[k], err_msg=f"{kw} {k}")


def test_the_gpus_attention_form_never_changes_a_request_either(model, monkeypatch):
    """The engine with the attention a GPU runs (kv_cache.attention_rows, forced on the CPU): continuous batching
    and static waves give every request the bits of one static batch, as with the CPU's blocks form; its tokens are
    the blocks form's wherever the two forms' log-probs are within float rounding of each other."""
    from triage_jax.models import kv_cache as kvc

    _, blocks = run(model, slots=15, continuous=False)
    calls = []

    def rows(*a, **kw):
        calls.append(1)
        return kvc.attention_rows(*a, **kw)

    monkeypatch.setattr(kvc, "attention_blocks", rows)
    jax.clear_caches()  # programs traced with the blocks form
    try:
        _, ref = run(model, slots=15, continuous=False)
        assert calls, "the engine did not trace the patched attention"
        for kw in (dict(slots=4), dict(slots=3, steps=7, continuous=False)):
            _, out = run(model, **kw)
            for k, v in as_np(out).items():
                np.testing.assert_array_equal(v, as_np(ref)[k], err_msg=f"{kw} {k}")
    finally:
        jax.clear_caches()  # no later test may reuse a program traced with the patched form
    np.testing.assert_array_equal(as_np(ref)["tokens"], as_np(blocks)["tokens"])
    np.testing.assert_allclose(as_np(ref)["logprobs"], as_np(blocks)["logprobs"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kv_cache, scan", [("bf16", False), ("fp8", True)])
def test_the_combined_kv_layout_gives_the_split_layouts_bits(model, kv_cache, scan):
    """The GPU's KV layout (kv_layout="combined": a layer's keys and values in one buffer, one scatter per write),
    forced on the CPU, against the CPU's (two buffers): the same tokens and log-probs bit for bit through
    continuous batching's insertions, capacity growth and tail compaction; with an FP8 cache (its per-layer scales
    set by the prefill) and with a scanned model's stacked cache too."""
    from triage_jax.sampler import sampler_policy

    if scan:
        model = Qwen3(get_model_config("tiny", num_hidden_layers=2, scan_layers=True), rngs=nnx.Rngs(0))
    policy = sampler_policy("bf16", kv_cache=kv_cache)
    kw = dict(slots=8, compact_tail=2, max_len=256, policy=policy,
              cfg=SamplingConfig(max_new_tokens=100, stop_ids=CFG.stop_ids))
    split_engine, split = run(model, kv_layout="auto", **kw)
    engine, combined = run(model, kv_layout="combined", **kw)
    assert not split_engine.kv_combined and engine.kv_combined  # "auto" is split on a CPU
    assert len(set(engine.capacities)) > 1 and min(engine.slot_counts) < 8  # grew, and compacted its tail
    want = as_np(split)
    for k, v in as_np(combined).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(max_slots=4, max_len=64, kv_layout="joint")


def test_tail_compaction_shrinks_the_slots_and_changes_no_request(model):
    """Once the queue is empty and at most half the slots decode (compact_tail=2), the long responses left move
    into a smaller slot set (16 -> 8 here, never below 4 per device) instead of decoding in all 16. Every
    request's tokens are the uncompacted run's and its log-probs agree to float32 rounding: XLA:CPU's dot sums
    16+ rows in another order than fewer (measured: 2-15 slots bit-identical, 16, 24, 32 one ulp apart), the
    same last-bit freedom as a capacity bucket. The same config and seed still give the same bits (rerun)."""
    engine, out = run(model, slots=16, compact_tail=2)
    plain, ref = run(model, slots=16, compact_tail=0)
    assert set(plain.slot_counts) == {16}
    assert engine.slot_counts[0] == 16 and min(engine.slot_counts) == 8
    assert engine.slot_counts == sorted(engine.slot_counts, reverse=True)  # it only ever shrinks
    got, want = as_np(out), as_np(ref)
    for k in ("tokens", "mask", "lengths"):
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=0, atol=2e-6)
    _, again = run(model, slots=16, compact_tail=2)
    for k, v in as_np(again).items():
        np.testing.assert_array_equal(v, got[k], err_msg=f"rerun {k}")
    _, static = run(model, slots=16, continuous=False)
    assert set(_.slot_counts) == {16}  # the static baseline keeps every slot to the end


def test_prefill_width_follows_the_prompt_budget(model):
    """With max_prompt_len known, prompts prefill at its bucket (16 columns for 11 tokens, not 64) at every prefill
    batch, so the schedule still never changes a request; the numbers agree with the 64-column prefill's to float
    rounding (XLA's CPU dot picks its kernel by shape: the last bit can move, as across prefill batch sizes)."""
    engine, ref = run(model, slots=15, continuous=False, max_prompt_len=11, prefill_batch=2)
    assert engine.prompt_bucket == 16
    for kw in (dict(slots=4), dict(slots=3, steps=7), dict(slots=5, continuous=False)):
        _, out = run(model, max_prompt_len=11, prefill_batch=2, **kw)
        for k, v in as_np(out).items():
            np.testing.assert_array_equal(v, as_np(ref)[k], err_msg=f"{kw} {k}")
    _, wide = run(model, slots=15, continuous=False, prefill_batch=2)
    np.testing.assert_array_equal(as_np(wide)["tokens"], as_np(ref)["tokens"])
    np.testing.assert_allclose(as_np(wide)["logprobs"], as_np(ref)["logprobs"], atol=1e-5)


def test_continuous_batching_refills_slots(model):
    engine, out = run(model, slots=4)
    static, _ = run(model, slots=4, continuous=False)
    assert engine.rounds < static.rounds  # freed slots are refilled instead of idling until the wave ends


def test_shared_prompts_prefill_once(model):
    """G samples of a prompt: one prefill row per prompt, G distinct responses, each exactly the log-probs the
    learner recomputes for it (float32)."""
    engine, out = run(model, slots=8, n=4, prompts=PROMPTS[:2])
    assert engine.prefills == 1
    toks = np.asarray(out.tokens)
    assert len({tuple(t) for t in toks[:4]}) > 1  # samples of one prompt differ
    lp = nnx.jit(lambda m, *a: response_logprobs(m, *a, vocab_chunk=64))(  # jitted, as the learner runs it
        model, out.prompt_tokens, out.prompt_mask, out.tokens, out.mask)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(out.logprobs), atol=2e-5)


def test_capacity_follows_the_tokens_held(model):
    """A 2048-slot budget does not make short sequences attend over 2048 slots: the cache grows in 64-slot
    buckets with the longest held sequence."""
    engine, out = run(model, slots=4, max_len=2048)
    held = int(max(len(p) for p in PROMPTS) + np.asarray(out.lengths).max())
    assert max(engine.capacities) <= 2 * held and max(engine.capacities) < 2048
    assert min(engine.capacities) == 64


def test_generate_matches_engine_and_orders_rows_prompt_major(model):
    out = generate(model, PROMPTS[:2], CFG, key=jax.random.key(0), pad_id=PAD, n=2, max_cache_len=128)
    _, ref = run(model, slots=4, n=2, prompts=PROMPTS[:2])
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert np.asarray(out.prompt_lengths).tolist() == [4, 4, 11, 11]


def test_one_token_responses_run_no_decode_round(model):
    """max_new_tokens=1: each response is the insert's draw from its prompt's logits, so no decode round runs (a
    fixed round would compute steps_per_round steps for nothing); the token and log-prob are the first of a
    longer generate's (the keys follow request and position)."""
    outs = {}
    for tokens in (1, 6):
        engine = Engine(SamplingConfig(max_new_tokens=tokens), EngineConfig(max_slots=4, max_len=64,
                                                                           round_loop="fixed"), pad_id=PAD, model=model)
        outs[tokens] = as_np(engine.generate(PROMPTS, jax.random.key(3), n=2))
        assert (engine.rounds == 0) == (tokens == 1)
    np.testing.assert_array_equal(outs[1]["lengths"], 1)
    np.testing.assert_array_equal(outs[1]["tokens"][:, 0], outs[6]["tokens"][:, 0])
    np.testing.assert_array_equal(outs[1]["logprobs"][:, 0], outs[6]["logprobs"][:, 0])


def test_bad_input_is_a_clear_error(model):
    with pytest.raises(ValueError, match=r"prompt 1 has 11 tokens.*needs 51 .*max_cache_len=48"):
        run(model, slots=2, max_len=48)
    with pytest.raises(ValueError, match="max_slots"):
        EngineConfig(max_slots=0, max_len=64)
    with pytest.raises(ValueError, match="compact_tail"):
        EngineConfig(max_slots=4, max_len=64, compact_tail=1)
    with pytest.raises(ValueError, match=r"round_loop must be one of .*'fixed'.*got 'fixd'"):
        EngineConfig(max_slots=4, max_len=64, round_loop="fixd")


def test_fixed_rounds_give_the_early_exit_bits_with_a_known_trip_count(model):
    """EngineConfig.round_loop: a fixed round runs every one of its steps (7 here: most last rounds end with steps
    in which no slot is active) and gives the same tokens, log-probs and lengths as rounds that exit early, in
    continuous batching and static waves, over the same number of rounds. Its compiled loop has a trip count XLA
    knows (on a GPU: no copy of the condition to the host and no wait for the device per step), the early-exit
    loop none; "auto" is early_exit on this CPU (fixed on GPUs)."""
    from triage_jax import sampler as smp

    for continuous in (True, False):
        early, ref = run(model, slots=4, steps=7, continuous=continuous, round_loop="early_exit")
        fixed, out = run(model, slots=4, steps=7, continuous=continuous, round_loop="fixed")
        assert fixed.fixed_rounds and not early.fixed_rounds
        assert fixed.rounds == early.rounds > 3
        for k, v in as_np(out).items():
            np.testing.assert_array_equal(v, as_np(ref)[k], err_msg=f"continuous={continuous} {k}")
    for engine, trip_count in ((fixed, '"known_trip_count":{"n":"7"}'), (early, None)):
        hlo = engine.compile_decode(4, 64, jax.random.key(0)).as_text()
        # The round's own loop (XLA:CPU's threefry adds inner loops of 5 rounds; on a GPU it is unrolled).
        (loop,) = [line for line in hlo.splitlines()
                   if " while(" in line and 'op_name="jit(_decode_round)/while"' in line]
        assert (trip_count in loop) if trip_count else ("known_trip_count" not in loop)
    assert not run(model, slots=2, n=1, prompts=PROMPTS[:1])[0].fixed_rounds  # auto on a CPU
    assert [smp.fixed_round_loop("auto", p) for p in ("gpu", "cpu", "tpu")] == [True, False, False]


@contextlib.contextmanager
def engine_compiles(*programs: str):
    """A list that collects (program, thread name) for each XLA compile of these jitted programs in the block."""
    compiled = []

    def listen(event, secs, **kw):
        if event.endswith("backend_compile_duration") and kw.get("fun_name") in programs:
            compiled.append((kw["fun_name"], threading.current_thread().name))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiled
    finally:
        monitoring.unregister_event_duration_listener(listen)


def test_first_round_programs_compile_side_by_side_ahead_of_the_calls():
    """EngineConfig.parallel_compile: the first round's prefill, insert and decode round compile on the engine's
    compile threads, for exactly the arguments the round then passes: the round's own calls compile none of them
    again (a mismatch with `_generate`'s scheduling would compile twice, on the main thread). Models of their own
    (vocabularies no other test uses), so no other test compiled these programs first; the serial baseline
    compiles the same three, one by one on the main thread."""
    programs = ("jit(_prefill)", "jit(_insert)", "jit(_decode_round)")
    for parallel, vocab in ((True, 200), (False, 201)):
        model = Qwen3(get_model_config("tiny", num_hidden_layers=1, vocab_size=vocab), rngs=nnx.Rngs(3))
        # 16 slots hold all 15 requests: one admission, one prefill batch, one insert, one capacity.
        engine = Engine(CFG, EngineConfig(max_slots=16, max_len=128, steps_per_round=4, compact_tail=0,
                                          parallel_compile=parallel), pad_id=PAD, model=model)
        with engine_compiles(*programs) as compiled:
            out = engine.generate(PROMPTS, jax.random.key(0), n=3)
            assert int(np.asarray(out.lengths).min()) >= 1
            assert sorted(p for p, _ in compiled) == sorted(programs), compiled  # each compiled exactly once
            threads = {t for _, t in compiled}
            assert threads == ({"engine-compile_0", "engine-compile_1", "engine-compile_2"} if parallel
                               else {"MainThread"}), compiled
            engine.generate(PROMPTS, jax.random.key(1), n=3)  # compiled shapes: no new compile anywhere
            assert len(compiled) == 3, compiled


def test_compile_ahead_compiles_the_next_capacity_off_the_main_thread():
    """EngineConfig.compile_ahead: once a round runs at capacity 64, the decode round at the larger buckets (128 =
    max_len here) compiles on a background thread, and the round that grows into 128 waits for it instead of
    compiling it again on the main thread. Without it, that compile happens on the main thread, mid-rollout."""
    cfg = SamplingConfig(max_new_tokens=90)  # 4-token prompts grow past 64 slots
    for ahead, vocab in ((True, 202), (False, 203)):
        model = Qwen3(get_model_config("tiny", num_hidden_layers=1, vocab_size=vocab), rngs=nnx.Rngs(3))
        engine = Engine(cfg, EngineConfig(max_slots=4, max_len=128, steps_per_round=8, compact_tail=0,
                                          compile_ahead=ahead), pad_id=PAD, model=model)
        with engine_compiles("jit(_decode_round)") as compiled:
            engine.generate([[5, 17, 99, 3]], jax.random.key(0), n=4)
        threads = [t for _, t in compiled]
        assert sorted(set(engine.capacities)) == [64, 128]
        assert len(threads) == 2, threads  # one program per capacity, never twice
        assert threads[0].startswith("engine-compile_"), threads  # the first round's, compiled side by side
        assert threads[1] == ("engine-compile-ahead" if ahead else "MainThread"), threads


def test_a_process_exits_cleanly_while_compiling_ahead():
    """A process that ends while the compile-ahead thread is inside XLA's compiler exits cleanly (a daemon thread
    still compiling when the interpreter finalizes aborts the process: rc 134); it waits for the compile under
    way only, not for the rest of the ladder (max_len 2048: buckets 128 .. 2048)."""
    import os
    import subprocess
    import sys
    import time

    script = (
        "import jax, threading\n"
        "from flax import nnx\n"
        "from triage_jax.models import Qwen3, get_model_config\n"
        "from triage_jax.sampler import Engine, EngineConfig, SamplingConfig\n"
        "model = Qwen3(get_model_config('tiny', num_hidden_layers=2), rngs=nnx.Rngs(0))\n"
        "eng = Engine(SamplingConfig(max_new_tokens=4), EngineConfig(max_slots=2, max_len=2048,\n"
        "             compile_ahead=True), model=model)\n"
        "eng.generate([[1, 2, 3]], jax.random.key(0))\n"
        "print('ALIVE', sum(t.name == 'engine-compile-ahead' and t.is_alive() for t in threading.enumerate()))\n")
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", JAX_COMPILATION_CACHE_DIR="")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ALIVE 1" in out.stdout  # it really exited with a compile ahead under way
    assert time.perf_counter() - t0 < 120


def test_warm_generate_never_hashes_the_graphdef(model, monkeypatch):
    """jit hashes its static arguments at every call, and a deep model's GraphDef hashes in milliseconds (2.1 ms at
    36 layers): the engine hands its programs a StaticGraph hashed once per load, so a warm generate (prefill,
    inserts, every decode round) hashes no GraphDef; a new load of the same structure reuses the same StaticGraph."""
    engine, _ = run(model, slots=4)
    cls = type(engine.graphdef)
    hashes = []
    original = cls.__hash__
    monkeypatch.setattr(cls, "__hash__", lambda self: hashes.append(1) or original(self))
    engine.generate(PROMPTS, jax.random.key(1), n=3)
    assert engine.rounds > 3 and hashes == []
    graph = engine._graph
    engine.load(model)  # the trainer's sync: the same structure again
    assert engine._graph is graph


def test_compile_decode_returns_the_program_a_round_ran(model):
    """Engine.compile_decode (what bench_gpu reads a decode step's kernels from): for a slot count and capacity a
    round ran at, the program comes from the compile cache (no compile) and holds the round's loop."""
    engine, _ = run(model, slots=4, round_loop="fixed")
    with engine_compiles("jit(_decode_round)") as compiled:
        hlo = engine.compile_decode(engine.slot_counts[0], engine.capacities[0], jax.random.key(5)).as_text()
    assert compiled == []
    assert '"known_trip_count":{"n":"4"}' in hlo and 'op_name="jit(_decode_round)/while"' in hlo
