"""Model organism: a 5.2M dense model on a step-by-step chain (synthetic level 7, count up) with a task BPE.

Level 7 reads "Start at a and add b until the total is over 100." (a 10..39, b 6..9) and is solved one addition
per line, `x+b=y`, 7-16 lines: reference solutions are 64-138 tokens (with the stop token) of the byte-level BPE
trained on the task's corpus (290 ids: the corpus runs out of merges below bpe.vocab_size; numbers in single
digits), so TRIAGE's 64-token segments split a response into 1-3 segments. Prompts are 23 tokens. W4A4 NVFP4
sampler, BF16 learner, TRIAGE, 32 responses (4 prompts x 8) per step, one update per step.

Measured on the shared 2-core CPU (experiments/README.md, "The model organism"): the 150-step batch-16 warm-up
set here takes 9 min (load 6-9) and ends at held-out avg@1 27/64 = 42% at T=1 with the W4A4 sampler (6% at step
75, 8% at 100, 19% at 125), so GRPO groups carry signal from the first step; one RL step takes 10.4 s at load
4.5 (rollout 3.8 s, learner 6.4 s on 32 rows of 24 + 144 tokens). A longer warm-up saturates the task (75% at
step 200 of a 600-step schedule). RL at the base lr 1e-4 degrades the policy with no mismatch at all
(BF16 sampler: rollout accuracy 0.31 -> 0.20 and entropy 0.135 -> 0.195 over 20 steps); 2e-5 (set here) holds it
(0.40 -> 0.40, entropy flat), 5e-5 drifts (0.39 -> 0.36). This config's 20 W4A4 steps: 9.1 s/step at load 7-8,
accuracy 0.42 -> 0.36 (steps 1-10 / 11-20; per step 0.25-0.53), 95-98% of groups mixed, entropy and delta_q05
flat. Levels 5 (column addition) and 6 (stories), the first choice, did not learn in time: 400 warm-up steps
reached an SFT loss of 0.53 nats/token and solved 0/32 held-out problems per level.
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
    c.optim.lr = 2e-5  # the base 1e-4 degrades even a BF16-sampler run of this policy (0.31 -> 0.20 in 20 steps)
    c.train.steps = 50
    return c
