"""Model organism: a 6.2M dense model on step-by-step chains (synthetic levels 5 and 6) with a task BPE.

Level 5 is long addition written column by column with carries, level 6 a story of 3-5 events worked one per
line; reference solutions are 62-144 tokens of a 1024-id byte-level BPE trained on the task's corpus (numbers in
single digits), so TRIAGE's 64-token segments split a response into 1-3 segments as they split the paper's
long chains. W4A4 NVFP4 sampler, BF16 learner, TRIAGE; the warm-up and RL sizes keep one GRPO step to a few
seconds on a 2-core CPU (figures in the commit that added this file and in experiments/README.md once measured).
"""

from triage_jax.config import base_config


def get_config():
    c = base_config()
    c.run_dir = "runs/organism"
    c.model.preset = "organism"
    c.tokenizer = "bpe"
    c.bpe.vocab_size = 1024
    c.data.levels = (5, 6)
    c.data.style = "words"  # level 6 is a story; level 5 reads "Add a and b."
    c.warmup.cache_dir = "runs/warmup_cache_organism"
    c.warmup.steps = 300
    c.warmup.batch_size = 32
    c.warmup.lr = 3e-3
    c.sampler.max_prompt_len = 80  # prompts are 17-74 tokens
    c.sampler.max_new_tokens = 160  # reference chains are 62-127 tokens with <|endoftext|>
    c.rl.num_prompts = 4
    c.rl.group_size = 8
    c.rl.mini_batch = 32
    c.rl.micro_batch = 32
    c.rl.triage.segment_len = 64  # as in the paper: 1-3 segments per response here
    c.train.steps = 50
    return c
