"""The main job on a laptop CPU: a tiny model learns, from sandbox verdicts, to fix its bugs.

Three generated environments (ptrain.envs.synthetic):
  code   write name(x) returning x <op> k; hidden unit tests (sandbox judge)
  arith  compute a <op> b by calling the python tool (run in the sandbox), then answer
         (multi-turn; the answer is compared with the right number on the host)
  files  a bash script that writes words to a file; run in the sandbox, judged by the files
         it leaves
A 0.4M-parameter decoder is first trained to convergence on demonstrations that are partly
wrong in a systematic way (a visible feature of the task triggers the bug), then trained
with GRPO on the sandbox's verdicts. Greedy pass rates on a held-out split (instances never
trained on) are measured after SFT and after RL.

Command:  make quickstart   (python -m launch.train --config=configs/quickstart.py
          --workdir=runs/quickstart); every stage first at its smallest, the smoke variant
          --config=configs/quickstart.py:smoke (48 s of CPU: 5 min 13 s wall on 2 cores
          shared at load ~19)
Hardware: 2 CPU cores, about 5 minutes (SFT 1000 steps ~2.5 min, RL 120 steps ~1.2 s each,
          two evaluations of 300 episodes); the sandbox uses the strongest backend available.
Expected: <workdir>/eval.jsonl: greedy held-out pass rate per domain (n=100) rises from
          0.23 (code), 0.66 (arith), 0.48 (files) after SFT to 1.00, 1.00, 0.98 after RL
          (a run on 2 CPU cores, docker backend; README, "What it has shown"; docs/closed_loop.md).
"""

from ptrain import config as config_lib
from ptrain import smoke


def get_config(arg: str = ""):
    """arg "short": a shortened run for tests (fewer tasks and steps, SFT rows no longer than
    the demonstrations); "smoke": every stage at the smallest size (`ptrain.smoke`).
    The closed loop's defaults (ptrain.config.defaults(closed_loop=True)) with what this
    experiment changes."""
    if arg not in ("", "short", "smoke"):
        raise ValueError(f"configs/quickstart.py:{arg}: the variants are 'short' and 'smoke'")
    short = arg == "short"
    c = config_lib.defaults(closed_loop=True)
    c.lock()  # a key that defaults() lacks is an error here
    c.steps = 20 if short else 120
    c.model.update(vocab_size=0,  # 0: the tokenizer's
                   d_model=128, n_heads=8, d_ff=256, tie_embeddings=True,
                   attention_impl="reference")  # <= 96 tokens: dense is as fast
    c.mesh.update(data=-1, fsdp=1)  # data parallel over all devices
    c.data.update(prompts_per_step=16, max_prompt_len=24)
    c.sampling.max_new_tokens = 48
    c.rl.update(clip_high=0.28, num_minibatches=2, tis_cap=2.0, staleness=1)
    c.optim.update(lr=1e-4, schedule="constant")
    # The short run's SFT rows are the demonstrations' longest prompt and completion (19 and
    # 50 tokens; make_tasks checks every one fits): the same loss, less padding to compute.
    c.sft.update(steps=400 if short else 1000, batch_size=64,
                 max_prompt_len=19 if short else 24, max_completion_len=50 if short else 56,
                 checkpoint_every=250)
    c.sft.optim.update(lr=3e-3, warmup_steps=20)
    c.log.num_rollouts = 8
    c.checkpoint.update(every=20, keep=2)
    # The closed loop (ptrain/closed_loop.py)
    c.tasks.envs = tuple(dict(env=env, weight=1.0, args=dict(
        n_train=600 if short else 3000, n_heldout=30 if short else 100))
        for env in config_lib.GENERATED)  # code, arith, files (ptrain.envs.synthetic)
    c.eval.n = 30 if short else 100
    return smoke.variant(c) if arg == "smoke" else c
