"""GRPO on a toy task: a tiny randomly initialised model learns to emit one given token.

Prompts are random token sequences; the reward of a completion is the fraction of its tokens
equal to TARGET. Nothing to download, no tokenizer: records carry token ids.

Command:  python -m launch.train --config=configs/grpo_toy.py --workdir=runs/grpo_toy
Hardware: one CPU core is enough (2 cores: about 20 s including compilation).
Expected: reward/mean in <workdir>/metrics.jsonl rises from about 1/32 to >= 0.9 within 30
steps (tests/test_learner.py runs this config and asserts it).
"""

import random

from ptrain import config as config_lib

VOCAB = 32
TARGET = 7


def prompt_records(seed):
    """256 prompts: BOS (1) then 1 to 6 random tokens."""
    rng = random.Random(seed)
    return [{"prompt_ids": [1] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))]}
            for _ in range(256)]


def reward(record, completion_ids, completion_text):
    del record, completion_text
    return sum(t == TARGET for t in completion_ids) / max(len(completion_ids), 1)


def get_config():
    """ptrain.config.defaults() with what this experiment changes."""
    c = config_lib.defaults()
    c.lock()  # a key that defaults() lacks is an error here
    c.steps = 30
    c.model.update(vocab_size=VOCAB, d_model=32, d_ff=64)
    c.data.update(records_fn=prompt_records, max_prompt_len=8)
    c.reward_fn = reward
    c.sampling.max_new_tokens = 8
    c.rl.update(clip_high=0.28, num_minibatches=2, microbatch_size=16, tis_cap=2.0)
    c.optim.update(lr=1e-2, schedule="constant", b2=0.99)
    c.sft.update(max_prompt_len=8, max_completion_len=8)
    c.sft.optim.schedule = "constant"
    c.checkpoint.keep = 2
    return c
