"""CAD on a laptop CPU: a tiny model writes CadQuery scripts for parametric parts, the
sandbox builds and measures them against the targets, and RL learns from the geometry.

The CAD environment (`ptrain.envs.cad`, docs/cad.md): parts from the families (plates with
hole rows, L-brackets, flanges, stepped shafts, shelled boxes, a pin-in-hole assembly), the
held-out split on parameter values the training split never draws. A 0.5M-parameter decoder
with a word tokenizer is trained on the reference scripts (SFT; a quarter of the
demonstrations first call the `cad` tool with one dimension wrong, read the measurement and
fix it), then with GRPO in
multi-turn episodes where it may call the `cad` tool (build, read the measurements, fix)
before its final script, rewarded by the gated IoU (0 unless the script builds a closed
solid). The greedy held-out reward and pass rate (IoU >= 0.95 and every check) are measured
after SFT and after RL.

Command:  python -m launch.train --config=configs/cad_toy.py --workdir=runs/cad_toy
Hardware: 2 CPU cores and a CAD sandbox backend (bash sandbox/setup_host.sh builds the venv
          and the ptrain-cad image). On a 2-core VM at load ~20: SFT 2-5 s a step, RL ~8 s a
          step (16 episodes, each verdict a build and a measurement in the sandbox).
Expected: <workdir>/eval.jsonl: greedy held-out pass rate after SFT and after RL. A shortened
          run (sft.steps=150, steps=8, eval.n=10) gave 0.00 -> 0.00: its scripts build for
          every held-out part but none reaches IoU 0.95 (docs/cad.md, "The toy run"); that
          run's demonstrations had no tool calls (fix_demos=0).
"""

from ptrain import config as config_lib


def get_config(arg: str = ""):
    """arg "short": a shortened run for tests (fewer tasks and steps). The closed loop's
    defaults (ptrain.config.defaults(closed_loop=True)) with what this experiment changes."""
    short = arg == "short"
    c = config_lib.defaults(closed_loop=True)
    c.lock()  # a key that defaults() lacks is an error here
    c.steps = 2 if short else 20
    c.model.update(vocab_size=0,  # 0: the tokenizer's
                   d_model=128, n_heads=8, d_ff=256, tie_embeddings=True,
                   attention_impl="reference")
    c.mesh.update(data=-1, fsdp=1)  # data parallel over all devices
    # Prompts are up to 227 tokens, reference scripts up to 169 (the word tokenizer spells
    # numbers digit by digit).
    c.data.update(prompts_per_step=2 if short else 4, max_prompt_len=232)
    c.sampling.update(max_new_tokens=192, num_samples=4)
    c.rl.update(clip_high=0.28, tis_cap=2.0)
    c.optim.update(lr=1e-4, schedule="constant")
    c.sft.update(steps=20 if short else 600, batch_size=16, max_prompt_len=232,
                 max_completion_len=640, checkpoint_every=250)
    c.sft.optim.update(lr=3e-3, warmup_steps=20)
    c.log.num_rollouts = 4
    c.checkpoint.update(every=10, keep=2)
    # The CAD environment alone, with its tool; verdicts need a CAD sandbox (docs/cad.md).
    c.tasks.envs = (dict(env="ptrain.envs.cad:make", weight=1.0, args=dict(
        n_train=12 if short else 60, n_heldout=6 if short else 20, tools=True,
        fix_demos=0.25)),)  # a quarter of the demonstrations build, read and fix
    # A turn that calls the tool, its measurement, then the final script.
    c.rollout.update(max_turns=2, max_len=640, max_tool_output_chars=600, tool_timeout_s=60.0)
    c.eval.n = 6 if short else 20
    return c
