"""RL on terminal tasks on a laptop CPU: a tiny model learns, from the tasks' own tests run in
docker, to create the folder it writes into.

Generated Harbor-layout tasks (`ptrain.terminal_tasks`: "terminal: write red fox to
lake/cat.txt", each a task directory with instruction.md, task.toml, environment/Dockerfile,
tests/test.sh, solution/solve.sh) run in the real docker environment (`sandbox.terminal`):
warm task containers reset between episodes, the agent's bash tool calls in a persistent
shell, the reward from each task's verifier. A 0.4M-parameter decoder with a word tokenizer
is first trained on demonstrations that usually forget `mkdir -p` when the path has a
folder, then with GRPO on the verifiers' rewards; the greedy held-out pass rate (32 tasks
never trained on) is measured after SFT and after RL (`ptrain/terminal_loop.py`).

Command:  python -m launch.train --config=configs/terminal_toy.py --workdir=runs/terminal_toy
Hardware: 2 CPU cores and docker with ptrain-term-base:latest (bash sandbox/setup_host.sh):
          SFT 400 steps, then 30 RL steps of 32 episodes (4 tasks x 8) in task containers;
          31 min on 2 cores shared at load 15-20 (SFT 21 min, RL 7.5 min, 10 s per step).
Expected: <workdir>/eval.jsonl: greedy held-out pass rate (n=32) 0.50 after SFT (0.11 on the
          tasks with a folder) -> 1.00 after RL (README "RL on terminal tasks").
"""

import ml_collections

from ptrain import alerts
from ptrain import config as config_lib


def get_config(arg: str = ""):
    """arg "short": a shortened run for tests (fewer tasks and steps)."""
    short = arg == "short"
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 4 if short else 30
    base = config_lib.defaults()
    c.model = base.model  # the rest (float32, no remat, no experts) as defaults() has it
    c.model.update(vocab_size=0,  # 0: the tokenizer's
                   d_model=128, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=256,
                   tie_embeddings=True,
                   attention_impl="reference")  # <= 96 tokens: dense is as fast
    c.hf_model = ""
    c.tokenizer = ""
    c.mesh = base.mesh
    c.mesh.update(data=-1, fsdp=1)  # data parallel over all devices
    c.data = dict(sources=(), records_fn=None, prompts_per_step=4, max_prompt_len=24,
                  on_error="raise")
    c.reward_fn = None
    c.sampling = dict(num_samples=8, max_new_tokens=56, temperature=1.0, top_k=0, top_p=1.0,
                      stop_token_ids=(), stop_strings=(), stop_check_every=16, engine=False,
                      engine_slots=32)
    c.rl = dict(estimator="grpo", loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                agg="token-mean", ppo_epochs=1, num_minibatches=2, microbatch_size=0,
                gamma=1.0, lam=1.0, entropy_coef=0.0, tis_cap=2.0, tis_level="token",
                logprob_chunk=256, logprob_microbatch_size=0, staleness=0, router_replay=False)
    c.critic = dict(init="policy", clip_value=0.5,  # used by rl.estimator="gae" only
                    optim=dict(lr=1e-5, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                               weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.kl = dict(coef=0.0, kind="k3", in_reward=False, target=0.0, horizon=10000.0)
    c.dapo = dict(overlong_buffer=0, overlong_penalty=1.0, overlong_max_len=0,
                  filter_overlong=False, dynamic_sampling=False, max_gen_batches=4)
    c.optim = dict(lr=1e-4, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                   weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0)
    c.sft = dict(sources=(), records_fn=None, steps=40 if short else 400, batch_size=32,
                 max_prompt_len=24, max_completion_len=96, microbatch_size=0,
                 checkpoint_every=250,
                 optim=dict(lr=3e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.0,
                            weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.log = dict(every=1, rollouts_every=10, num_rollouts=8)
    c.checkpoint = dict(every=10, keep=2, async_save=True)
    c.alerts = alerts.defaults()  # what stops or warns (ptrain/alerts.py)
    # Terminal tasks (ptrain/terminal_loop.py)
    c.terminal = dict(n_train=40 if short else 400, n_heldout=8 if short else 32, bug_rate=0.7,
                      max_turns=2, max_len=96, max_output_chars=200, call_timeout_s=10.0,
                      threads=16, max_idle=64, image_map=())
    c.lock()
    return c
