"""Paper-scale DAPO recipe shared by the Qwen3 configs (DAPO-Math-17k, 512 prompts x 16, token-mean, no KL)."""

from triage_jax.config import base_config


def dapo_config(preset: str):
    c = base_config()
    c.run_dir = f"runs/{preset}"
    c.model.preset = preset
    c.model.hf_path = ""  # required: --config.model.hf_path=/path/to/Qwen3 checkpoint
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = "full"
    c.model.attn_chunk = 512  # 22.5k-token learner sequences: never materialize [B, N, T, T] scores
    c.model.scan_layers = True  # the learner step compiles one layer, not 36 (minutes -> seconds); sampler unrolled
    c.tokenizer = ""  # defaults to <hf_path>/tokenizer.json
    c.data.source = "dapo"
    c.data.path = ""  # required: --config.data.path=/path/to/dapo-math-17k.parquet
    c.data.template = "dapo"
    c.warmup.enabled = False
    c.sampler.precision = "w4a4"
    c.sampler.temperature = 1.0
    c.sampler.max_prompt_len = 2048
    c.sampler.max_new_tokens = 20480
    c.learner.precision = "w4a4"
    c.learner.vocab_chunk = 16384
    c.rl.num_prompts = 512
    c.rl.group_size = 16
    c.rl.mini_batch = 512
    c.rl.micro_batch = 16
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.28
    c.rl.agg = "token-mean"
    c.rl.kl_coef = 0.0
    c.rl.dynamic_sampling = True
    c.rl.overlong_buffer = 4096
    c.rl.overlong_factor = 1.0
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.1
    c.optim.grad_clip = 1.0
    c.train.steps = 1000
    c.train.ckpt_every = 20
    c.mesh.fsdp = 8
    if preset.startswith("qwen3_30b"):
        c.mesh.fsdp, c.mesh.expert = 8, 8  # experts sharded over the expert axis as well
        c.rl.micro_batch = 64  # the batch splits over fsdp*expert = 64 devices: one response each
    return c
