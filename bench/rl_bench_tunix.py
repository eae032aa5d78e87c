"""The Tunix side of bench/rl_bench.py; runs in the bench-only venv bench/.venv-tunix.

Loads the Qwen3 checkpoint rl_bench.py wrote, then measures Tunix's sampler (decode tokens/s)
and Tunix's GRPO learner (seconds per RL step) on the workload given as JSON, and prints one
JSON line with the results ("decode_only": the sampler alone, for bench/rollout_bench.py;
"lora": GRPO only, with qwix LoRA adapters on the actor and the base as the reference policy,
as Tunix's GRPO LoRA examples build it). Imports nothing of ptrain.
"""

import json
import sys
import time

import grain
import jax
import numpy as np
import optax
import qwix
from flax import nnx
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
    out = {}
    if not work.get("lora"):
        out["decode_s"] = decode(work, mesh, vocab, texts)
        if work.get("decode_only"):  # bench/rollout_bench.py: the sampler alone
            print(json.dumps(out))
            return
    out["rl_step_s"], out["rl_steps_timed"] = grpo(work, mesh, vocab, texts)
    print(json.dumps(out))


def decode(work, mesh, vocab, texts):
    """(min, median) seconds of Tunix's sampler on G copies of every prompt."""
    g, new, plen = work["num_samples"], work["new_tokens"], work["prompt_len"]
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
    return [float(np.min(times)), float(np.median(times))]


def lora_actor(base, lora):
    """The base with qwix LoRA adapters on the modules `lora["module_path"]` matches (B zero,
    so the actor starts as the base); the base's weights are shared, not copied."""
    provider = qwix.LoraProvider(module_path=lora["module_path"], rank=lora["rank"],
                                 alpha=lora["alpha"])
    actor = qwix.apply_lora_to_model(base, provider, rngs=nnx.Rngs(0),
                                     **base.get_model_input())
    n = sum(x.size for x in jax.tree.leaves(nnx.state(actor, nnx.LoRAParam)))
    assert n, f"qwix matched no module with {lora['module_path']!r}"
    return actor, n


def grpo(work, mesh, vocab, texts):
    """(min, median) seconds per GRPO step of Tunix's GRPOLearner, and the steps timed."""
    g, new, plen = work["num_samples"], work["new_tokens"], work["prompt_len"]
    model, _ = load(work, mesh)
    reference = None
    if work.get("lora"):
        reference = model
        model, n_adapter = lora_actor(model, work["lora"])
        print(f"qwix LoRA: {n_adapter} adapter parameters", file=sys.stderr)
    steps = work["warmup"] + work["steps"] + 1  # one reward call per step: n + 1 stamps
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=reference, tokenizer=vocab,
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
        algo_config=grpo_learner.GRPOConfig(num_generations=g, num_iterations=1,
                                            beta=work.get("beta", 0.0),
                                            epsilon=0.2, loss_agg_mode="token-mean"))
    n_prompts = work["prompts_per_step"]
    dataset = (grain.MapDataset.source(texts).repeat(None).batch(n_prompts)
               .map(lambda x: {"prompts": x}))
    learner.train(dataset)
    intervals = np.diff(stamps)[work["warmup"]:]
    return [float(np.min(intervals)), float(np.median(intervals))], len(intervals)


if __name__ == "__main__":
    main()
