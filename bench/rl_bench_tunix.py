"""The Tunix side of bench/rl_bench.py; runs in the bench-only venv bench/.venv-tunix.

Loads the Qwen3 checkpoint rl_bench.py wrote, then measures Tunix's sampler (decode tokens/s)
and Tunix's GRPO learner (seconds per RL step) on the workload given as JSON, and prints one
JSON line with the results ("decode_only": the sampler alone, for bench/rollout_bench.py).
Imports nothing of ptrain.
"""

import json
import sys
import time

import grain
import jax
import numpy as np
import optax
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3
from tunix.models.qwen3 import params as qwen3_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout


class WordVocab:
    """Token i is the word "w<i>"; 0 pad, 1 BOS, 2 EOS (the same ids ptrain's side uses)."""

    def encode(self, text, **kwargs):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(f"w{int(i)}" for i in ids)

    def bos_id(self):
        return 1

    def eos_id(self):
        return 2

    def pad_id(self):
        return 0


def load(work, mesh):
    m = work["model"]
    config = qwen3.ModelConfig(
        num_layers=m["n_layers"], vocab_size=m["vocab_size"], embed_dim=m["d_model"],
        hidden_dim=m["d_ff"], num_heads=m["n_heads"], head_dim=m["head_dim"],
        num_kv_heads=m["n_kv_heads"], rope_theta=int(m["rope_theta"]), norm_eps=m["rms_eps"],
        use_tied_embedding=m["tie_embeddings"])
    return qwen3_params.create_model_from_safe_tensors(work["model_dir"], config, mesh), config


def main():
    work = json.loads(sys.argv[1])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    vocab = WordVocab()
    texts = [vocab.decode(p[1:]) for p in work["prompts"]]  # Tunix adds the BOS itself
    g, new, plen = work["num_samples"], work["new_tokens"], work["prompt_len"]
    out = {}

    # ------------------------------------------------------------------ decode tokens/s
    model, config = load(work, mesh)
    cache = sampler_lib.CacheConfig(cache_size=plen + new, num_layers=config.num_layers,
                                    num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    sampler = sampler_lib.Sampler(model, vocab, cache)
    batch = [t for t in texts for _ in range(g)]  # G copies of each prompt, as GRPO does

    def generate(seed):
        # No EOS can occur (-1): every row decodes `new` tokens, like the other samplers.
        result = sampler(batch, max_generation_steps=new, max_prompt_length=plen,
                         temperature=1.0, top_p=1.0, seed=seed, eos_tokens=[-1])
        assert all(len(t) == new for t in result.tokens)

    generate(0)  # compilation
    times = []
    for r in range(work["repeats"]):
        start = time.perf_counter()
        generate(r + 1)
        times.append(time.perf_counter() - start)
    out["decode_s"] = [float(np.min(times)), float(np.median(times))]
    if work.get("decode_only"):  # bench/rollout_bench.py: the sampler alone
        print(json.dumps(out))
        return

    # ------------------------------------------------------------------ GRPO steps
    model, _ = load(work, mesh)
    steps = work["warmup"] + work["steps"] + 1  # one reward call per step: n + 1 stamps
    cluster = rl_cluster_lib.RLCluster(
        actor=model, tokenizer=vocab,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh,
                          rl_cluster_lib.Role.REFERENCE: mesh,
                          rl_cluster_lib.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                                            optax.adamw(work["lr"])),
                eval_every_n_steps=10**6, max_steps=steps),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=new, max_prompt_length=plen,
                kv_cache_size=plen + new, temperature=1.0, top_p=1.0, eos_tokens=[2])))
    stamps = []

    def reward(prompts, completions, **kwargs):
        stamps.append(time.perf_counter())  # once per RL step
        return [sum(w == f"w{work['target']}" for w in c.split()) / max(len(c.split()), 1)
                for c in completions]

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward,
        algo_config=grpo_learner.GRPOConfig(num_generations=g, num_iterations=1, beta=0.0,
                                            epsilon=0.2, loss_agg_mode="token-mean"))
    n_prompts = work["prompts_per_step"]
    dataset = (grain.MapDataset.source(texts).repeat(None).batch(n_prompts)
               .map(lambda x: {"prompts": x}))
    learner.train(dataset)
    intervals = np.diff(stamps)[work["warmup"]:]
    out["rl_step_s"] = [float(np.min(intervals)), float(np.median(intervals))]
    out["rl_steps_timed"] = len(intervals)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
