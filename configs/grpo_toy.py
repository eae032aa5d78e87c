"""GRPO on a toy task: a tiny randomly initialised model learns to emit one given token.

Prompts are random token sequences; the reward of a completion is the fraction of its tokens
equal to TARGET. Nothing to download, no tokenizer: records carry token ids.

Command:  python -m launch.train --config=configs/grpo_toy.py --workdir=runs/grpo_toy
Hardware: one CPU core is enough (2 cores: about 20 s including compilation).
Expected: reward/mean in <workdir>/metrics.jsonl rises from about 1/32 to >= 0.9 within 30
steps (tests/test_learner.py runs this config and asserts it).
"""

import random

import ml_collections

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
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 30
    c.model = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                   tie_embeddings=False, rope_theta=10000.0, dtype="float32",
                   param_dtype="float32", remat="none", attention_impl="blockwise",
                   attn_block_q=512, attn_block_k=512)
    c.hf_model = ""
    c.tokenizer = ""
    c.mesh = dict(data=1, fsdp=-1, sequence=1, tensor=1)
    c.data = dict(sources=(), records_fn=prompt_records, prompts_per_step=8, max_prompt_len=8,
                  on_error="raise")
    c.reward_fn = reward
    c.sampling = dict(num_samples=8, max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0,
                      stop_token_ids=(), stop_strings=(), stop_check_every=16)
    c.rl = dict(estimator="grpo", loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                agg="token-mean", ppo_epochs=1, num_minibatches=2, microbatch_size=16,
                gamma=1.0, lam=1.0, entropy_coef=0.0, tis_cap=2.0, tis_level="token",
                logprob_chunk=256, staleness=0)
    c.critic = dict(init="policy", clip_value=0.5,  # used by rl.estimator="gae" only
                    optim=dict(lr=1e-5, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                               weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.kl = dict(coef=0.0, kind="k3", in_reward=False, target=0.0, horizon=10000.0)
    c.dapo = dict(overlong_buffer=0, overlong_penalty=1.0, dynamic_sampling=False,
                  max_gen_batches=4)
    c.optim = dict(lr=1e-2, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                   weight_decay=0.0, b1=0.9, b2=0.99, eps=1e-8, grad_clip=1.0)
    c.sft = dict(sources=(), records_fn=None, steps=0, batch_size=8, max_prompt_len=8,
                 max_completion_len=8, microbatch_size=0, checkpoint_every=0,
                 optim=dict(lr=1e-3, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                            weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.log = dict(every=1, rollouts_every=10, num_rollouts=4)
    c.checkpoint = dict(every=10, keep=2, async_save=True)
    c.lock()
    return c
