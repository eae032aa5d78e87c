"""PPO with a learned value function (GAE) on grpo_toy's task: a tiny randomly initialised
model learns to emit one given token.

Everything but the estimator and the critic is grpo_toy's (same prompts, reward, model and
optimizer). The critic starts as a copy of the policy's decoder with a fresh value head; its
clipped value loss trains on the same minibatches as the actor.

Command:  python -m launch.train --config=configs/ppo_toy.py --workdir=runs/ppo_toy
Hardware: one CPU core is enough (2 cores: about 30 s including compilation).
Expected: reward/mean in <workdir>/metrics.jsonl rises from about 1/32 to >= 0.9 within 30
steps; critic/vf_loss falls and critic/vf_explained_var rises (tests/test_learner.py runs
this config and asserts it).
"""

from configs import grpo_toy

TARGET, VOCAB = grpo_toy.TARGET, grpo_toy.VOCAB


def get_config():
    c = grpo_toy.get_config()
    c.rl.estimator = "gae"
    c.critic.optim.update(lr=1e-2, weight_decay=0.0, b2=0.99)
    return c
