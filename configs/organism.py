"""Model organism: a 5.2M dense model on step-by-step chains (synthetic levels 5 and 6) with a task BPE.

Level 5 is long addition written column by column with carries, level 6 a story of 3-4 events worked one per
line; reference solutions are 62-127 tokens (with the stop token) of a 1024-id byte-level BPE trained on the
task's corpus (numbers in single digits), so TRIAGE's 64-token segments split a response into 1-2 segments.
W4A4 NVFP4 sampler, BF16 learner, TRIAGE, 32 responses (4 prompts x 8) per step, one update per step.

Measured on the shared 2-core CPU (heavily loaded, load average 4-9), not yet good enough for RL: a 300-step
warm-up at batch 16 brings the SFT loss from 7.0 to 0.80 nats/token and solves no held-out problem (avg@1 0/64
at T=1, W4A4 sampler); at step 400 of the 800-step schedule set here the loss is 0.53 and avg@1 is still 0/32
on each level (36 min of SFT at that load). The 800-step end is not measured (experiments/organism_warmup.py
measures it and caches the result). One GRPO step from a random init (160-token responses, dynamic sampling
off) took 31-34 s at load 9 (rollout 7 s, learner 25 s).
"""

from triage_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/organism"
    c.model.preset = "organism"
    c.tokenizer = "bpe"
    c.bpe.vocab_size = 1024
    c.data.levels = (7,)  # count up (levels 5-6 measured too slow to learn on 2 cores: see the docstring)
    c.data.style = "words"  # "Start at a and add b until the total is over 100."
    c.warmup.cache_dir = "runs/warmup_cache_organism"
    c.warmup.steps = 150
    c.warmup.batch_size = 16
    c.warmup.lr = 3e-3
    c.sampler.max_prompt_len = 24  # prompts are 23 tokens
    c.sampler.max_new_tokens = 144  # reference chains are 64-138 tokens with <|endoftext|>
    c.rl.num_prompts = 4
    c.rl.group_size = 8
    c.rl.mini_batch = 32
    c.rl.micro_batch = 32
    c.rl.triage.segment_len = 64  # as in the paper
    c.train.steps = 50
    return c
