"""Packed SFT on a toy copy task: (prompt, completion) records packed back to back.

Each record is BOS (1), 3 to 24 random tokens, SEP (2), then the completion: the same tokens
again and EOS (3). `sft.packing` puts records back to back in sft.batch_size rows of
sft.seq_len tokens (segment ids and positions restart per record, a record that does not fit
waits for the next step) and trains them with `ptrain.step.packed_update`, the step
`launch.plan` compiles for the long-context plans, with ring attention over the mesh's
`sequence` axis. The loss covers completion tokens only. No RL steps (steps=0).

Command:  python -m launch.train --config=configs/sft_packed_toy.py --workdir=runs/sft_packed
          XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m launch.train \
            --config=configs/sft_packed_toy.py --config.mesh.sequence=2 --workdir=runs/sp2
            (ring attention over 2 sequence shards in the zigzag layout: the same losses)
Hardware: any CPU (2 cores: about 20 s, compilation included).
Expected: <workdir>/sft/metrics.jsonl: sft/loss falls from 3.48 (about ln 32) to 2.26 at
          step 150, about 33 records per step (sft/documents), rows over 92% filled
          (sft/fill); with --config.mesh.sequence=2 the same losses to float32 tolerance
          (tests/test_packing.py asserts that equality on a smaller run).
"""

import random

from ptrain import config as config_lib

VOCAB = 32


def copy_records(seed):
    """1,000 records: BOS, tokens, SEP as the prompt; the tokens again and EOS to learn."""
    rng = random.Random(seed)
    out = []
    for _ in range(1000):
        tokens = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 24))]
        out.append({"prompt_ids": [1] + tokens + [2], "completion_ids": tokens + [3]})
    return out


def copy_reward(record, completion_ids, completion_text):
    """1 for the prompt's tokens copied and EOS (for RL after SFT: --config.steps=N)."""
    del completion_text
    return float(list(completion_ids) == record["prompt_ids"][1:-1] + [3])


def get_config():
    """ptrain.config.defaults() with what this experiment changes."""
    c = config_lib.defaults()
    c.lock()  # a key that defaults() lacks is an error here
    c.steps = 0  # SFT only
    c.model.update(vocab_size=VOCAB, d_model=64, d_ff=128, attention_impl="ring",
                   attn_block_q=64, attn_block_k=64)
    c.data.update(records_fn=copy_records, max_prompt_len=26)  # RL's (--config.steps=N)
    c.reward_fn = copy_reward
    c.sampling.update(max_new_tokens=26, stop_token_ids=(3,))
    c.sft.update(records_fn=copy_records, steps=150, batch_size=2, packing=True, seq_len=512,
                 layout="zigzag", checkpoint_every=50)
    c.sft.optim.update(lr=3e-3, warmup_steps=10)
    return c
