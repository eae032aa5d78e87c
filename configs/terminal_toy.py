"""RL on terminal tasks on a laptop CPU: a tiny model learns, from the tasks' own tests run in
docker, to create the folder it writes into.

Generated Harbor-layout tasks (`ptrain.envs.terminal.generated`: "terminal: write red fox to
lake/cat.txt", each a task directory with instruction.md, task.toml, environment/Dockerfile,
tests/test.sh, solution/solve.sh) run in the real docker environment (`sandbox.terminal`):
warm task containers reset between episodes, the agent's bash tool calls in a persistent
shell, the reward from each task's verifier. A 0.4M-parameter decoder with a word tokenizer
is first trained on demonstrations that usually forget `mkdir -p` when the path has a
folder, then with GRPO on the verifiers' rewards; the greedy held-out pass rate (32 tasks
never trained on) is measured after SFT and after RL: the closed loop (`ptrain/closed_loop.py`)
with the terminal environment alone (`ptrain.envs.terminal`); add other environments to
tasks.envs (the union of their word tokenizers, each with its weight) to mix them.

Command:  python -m launch.train --config=configs/terminal_toy.py --workdir=runs/terminal_toy
          (the smoke variant first, every stage at the smallest size: terminal_toy.py:smoke)
Hardware: 2 CPU cores and docker with ptrain-term-base:latest (bash sandbox/setup_host.sh):
          SFT 400 steps, then 30 RL steps of 32 episodes (4 tasks x 8) in task containers;
          31 min on 2 cores shared at load 15-20 (SFT 21 min, RL 7.5 min, 10 s per step);
          22 min at load 17-30 niced on the closed loop (SFT 15.5 min, RL 6.5 min).
Expected: <workdir>/eval.jsonl: greedy held-out pass rate (n=32) 0.50 after SFT (0.11 on the
          tasks with a folder) -> 1.00 after RL (docs/terminal.md, "A real run").
"""

from ptrain import config as config_lib
from ptrain import smoke


def get_config(arg: str = ""):
    """arg "short": a shortened run for tests (fewer tasks and steps); "smoke": every stage
    at the smallest size (`ptrain.smoke`). The closed loop's
    defaults (ptrain.config.defaults(closed_loop=True)) with what this experiment changes."""
    if arg not in ("", "short", "smoke"):
        raise ValueError(f"configs/terminal_toy.py:{arg}: the variants are 'short' and 'smoke'")
    short = arg == "short"
    c = config_lib.defaults(closed_loop=True)
    c.lock()  # a key that defaults() lacks is an error here
    c.steps = 4 if short else 30
    c.model.update(vocab_size=0,  # 0: the tokenizer's
                   d_model=128, n_heads=8, d_ff=256, tie_embeddings=True,
                   attention_impl="reference")  # <= 96 tokens: dense is as fast
    c.mesh.update(data=-1, fsdp=1)  # data parallel over all devices
    c.data.update(prompts_per_step=4, max_prompt_len=24)
    c.sampling.max_new_tokens = 56
    c.rl.update(clip_high=0.28, num_minibatches=2, tis_cap=2.0)
    c.optim.update(lr=1e-4, schedule="constant")
    c.sft.update(steps=40 if short else 400, batch_size=32, max_prompt_len=24,
                 max_completion_len=96, checkpoint_every=250)
    c.sft.optim.update(lr=3e-3, warmup_steps=20)
    c.log.num_rollouts = 8
    c.checkpoint.update(every=10, keep=2)
    # The terminal environment alone (ptrain.envs.terminal); its episodes' caps in rollout.*
    # (its arg max_len 0: rollout.max_len)
    c.tasks.envs = (dict(env="ptrain.envs.terminal:make", weight=1.0, args=dict(
        n_train=40 if short else 400, n_heldout=8 if short else 32)),)
    c.rollout.update(max_turns=2, max_len=96, max_tool_output_chars=200, tool_timeout_s=10.0)
    c.eval.n = 8 if short else 32
    return smoke.variant(c) if arg == "smoke" else c
