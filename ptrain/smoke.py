"""A config's `:smoke` variant: every stage the run has at the smallest sizes that still run
it, so the whole path runs end to end in minutes on a laptop CPU before the real run.

    return smoke.variant(c) if arg == "smoke" else c      # in a configs/ file
"""

from __future__ import annotations

import ml_collections

from ptrain.config import GENERATED


def variant(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` as its smoke variant, in place: a brought model's base evaluation, SFT, RL and the
    held-out evaluations at their smallest; the model, tokenizer, environments and algorithm
    stay the config's."""
    c.steps = min(c.steps, 2)
    c.data.prompts_per_step = 2
    c.sampling.update(num_samples=2, max_new_tokens=min(c.sampling.max_new_tokens, 32))
    c.rl.update(num_minibatches=1, microbatch_size=0, logprob_microbatch_size=0)
    if c.sft.steps:
        c.sft.update(steps=min(c.sft.steps, 10), batch_size=min(c.sft.batch_size, 8),
                     microbatch_size=0, checkpoint_every=0)
    c.checkpoint.every = 1
    c.log.rollouts_every = 1
    if "tasks" in c:
        c.eval.update(n=min(c.eval.n, 4), sample=False)
        c.sandbox.workers = 1
        c.rollout.update(max_turns=min(c.rollout.max_turns, 2),
                         max_len=min(c.rollout.max_len, 4 * c.sampling.max_new_tokens))
        c.dapo.overlong_buffer = min(c.dapo.overlong_buffer, c.rollout.max_len)
        c.tasks.envs = tuple(_smoke_env(dict(entry)) for entry in c.tasks.envs)
    return c


# Smoke sizes of the built-in generated environments' args (a user's environment keeps its
# own args, capped where it names the same ones).
_SMOKE_CAPS = {"n_train": 64, "n_heldout": 4, "threads": 4}
_GENERATED_ARGS = {**{env: ("n_train", "n_heldout") for env in GENERATED},
                   "ptrain.envs.terminal:make": ("n_train", "n_heldout", "threads")}


def _smoke_env(entry: dict) -> dict:
    args = dict(entry.get("args") or {})
    for key in {*args, *_GENERATED_ARGS.get(entry.get("env"), ())} & set(_SMOKE_CAPS):
        args[key] = min(args.get(key, _SMOKE_CAPS[key]), _SMOKE_CAPS[key])
    return {**entry, "args": args}
