"""Charts on a laptop CPU: a tiny vision-language model (Qwen2.5-VL layout) reads generated
report pages (bar charts, line charts, tables) and answers questions that need reading them
and some arithmetic; SFT on the reference answers, then GRPO on the numeric verdicts, with the
held-out accuracy measured after each.

The charts environment (`ptrain.envs.charts`, docs/charts.md): pages of 224x168 pixels (48
merged image tokens each), the held-out split on other names and years than training; an
answer is the value after "Answer:", judged within half a unit of the asked precision.

The argument is the model directory: a Qwen2.5-VL checkpoint with its tokenizer and chat
template (config.json, *.safetensors, preprocessor_config.json), e.g. the tiny random one of
examples/tiny_vl_model.py; then ",short" for a shortened run. The learner loads it as a
VLModel (`ptrain.vision.run`); the environment's demonstrations (each training task's
reference answer, its page with it) are the SFT records, and every SFT and RL row carries
its page (`vision.prompt_patches`).

Command:  PYTHONPATH=.:tests python examples/tiny_vl_model.py runs/tiny_vl
          python -m launch.train --config=configs/charts_toy.py:runs/tiny_vl --workdir=runs/charts
Hardware: 2 CPU cores (the model is tiny). The 444 pages are drawn once into the work dir
          first: a few minutes on a loaded 2-core VM (~0.5 s a page).
Expected: <workdir>/eval.jsonl: greedy held-out pass rate at base, after SFT and after RL.
          Measured on the tiny random model of examples/tiny_vl_model.py (2-core VM loaded by
          other work, ~8 min in all): held-out greedy pass@1 0/40 at base (every answer cut
          at max_new_tokens), 0/40 after SFT (all 40 answered in the "Answer: <value>" form;
          SFT loss 6.41 -> 0.62 over 300 steps), 0/40 after 40 GRPO steps (training reward
          0.009 on average: 11 of 1280 rollouts right). The loop runs and learns the answer
          form; a model this small does not learn to read the numbers off the page.
"""

from ptrain import config as config_lib


def get_config(arg: str = ""):
    """arg: the model directory, then ",short" for a shortened run. The closed loop's defaults
    (ptrain.config.defaults(closed_loop=True)) with what this experiment changes."""
    model_dir, _, variant = arg.partition(",")
    if variant not in ("", "short"):
        raise ValueError(f"configs/charts_toy.py:{arg}: after the model directory, ',short' "
                         "or nothing")
    short = variant == "short"
    c = config_lib.defaults(closed_loop=True)
    c.lock()  # a key that defaults() lacks is an error here
    c.hf_model = c.tokenizer = model_dir  # config.json gives the architecture
    c.steps = 2 if short else 40
    c.mesh.update(data=-1, fsdp=1)
    # The prompt: the chat template, 48 image tokens, a question of ~40 tokens.
    c.data.update(prompts_per_step=2 if short else 8, max_prompt_len=192)
    c.sampling.update(max_new_tokens=16, num_samples=4)
    c.rl.update(clip_high=0.28)
    c.optim.update(lr=1e-4, schedule="constant")
    c.sft.update(steps=10 if short else 300, batch_size=8, max_prompt_len=192,
                 max_completion_len=16)
    c.sft.optim.update(lr=1e-3, warmup_steps=10)
    c.tasks.envs = (dict(env="ptrain.envs.charts:make", weight=1.0, args=dict(
        n_train=16 if short else 400, n_heldout=4 if short else 40, width_px=224,
        height_px=168)),)
    c.rollout.update(chat_format="qwen", max_turns=1, max_len=16)
    # Each row's image patches: one 224x168 page is 12 x 16 = 192 patches (48 merged tokens)
    # at the processing's max_pixels; the tower is trained with the decoder.
    c.vision.update(prompt_patches=192, freeze=False)
    c.eval.n = 4 if short else 40
    return c
