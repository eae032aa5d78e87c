"""MoE memory plans (dry runs): Qwen3-30B-A3B at 32k tokens, and a Kimi-K2-class model.

Nothing is downloaded or run: `launch.plan` builds the model abstractly and, with --search,
compiles the packed training step (`ptrain.step.packed_update`, packed SFT's: AdamW, float32
parameters and moments, bfloat16 compute, full remat) for the candidate meshes of each device
count, the expert axis among them (`ptrain.plan.candidate_meshes`), on simulated CPU devices.
Shapes from the public config.json files: Qwen/Qwen3-30B-A3B; moonshotai/Kimi-K2-Instruct
(61 layers, d 7168, 384 experts of 2048, 8 active, 1 shared expert, layer 0 dense with 18432;
its MLA attention replaced by grouped-query attention with 64 query and 8 kv heads of 128,
about the same parameters). Capacity dispatch (factor 1.25): on XLA's CPU compiler
`ragged_dot` is a masked dense matmul over all experts, whose buffers say nothing about a GPU
or TPU.

Command:  python -m launch.plan --config=configs/moe_plan.py --search
          python -m launch.plan --config=configs/moe_plan.py:kimi-k2 --search
          (--config.budget_gib=141 for H200; the default 95 is TPU v5p)
Hardware: any CPU (it simulates the devices). On 2 shared cores (load 6-25) the Qwen3
          search took 19 min, the Kimi-K2 one 31 min (compiles of 1-14 min each).
Expected: Qwen3-30B-A3B, one 32,768-token sequence: 8 devices (sequence=4 x tensor=2, peak
          72.1 GiB) for both budgets; 4 need 142.9 GiB. Kimi-K2, 256 sequences of 4096
          tokens: 256 devices (fsdp=2 x expert=128, 93.1 GiB per device); 128 need 164.3
          GiB (docs/benchmarks.md, "Mixture of experts").
"""

from ptrain import config as config_lib

MODELS = {
    "qwen3-30b-a3b": dict(
        vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        d_ff=6144, qk_norm=True, n_experts=128, n_experts_per_token=8, d_ff_expert=768,
        norm_topk_prob=True, rope_theta=1e6, max_position_embeddings=40960),
    "kimi-k2": dict(
        vocab_size=163840, d_model=7168, n_layers=61, n_heads=64, n_kv_heads=8, head_dim=128,
        d_ff=18432, n_experts=384, n_experts_per_token=8, d_ff_expert=2048, n_shared_experts=1,
        dense_layers=(0,), norm_topk_prob=True, rope_theta=50000.0,
        max_position_embeddings=131072),
}

# Per model: tokens per sequence, sequences per step, device counts the search walks.
SHAPES = {
    "qwen3-30b-a3b": dict(seq_len=32768, batch=1, device_counts=(4, 8)),
    "kimi-k2": dict(seq_len=4096, batch=256, device_counts=(128, 256, 512)),
}


def get_config(model: str = "qwen3-30b-a3b"):
    """ptrain.config.plan_defaults() for one of MODELS."""
    if model not in MODELS:
        raise ValueError(f"configs/moe_plan.py:{model}: use one of {sorted(MODELS)}")
    shape = SHAPES[model]
    ring = model == "qwen3-30b-a3b"  # 32k tokens on one host: the sequence axis may help
    c = config_lib.plan_defaults()
    c.model = dict(**MODELS[model], param_dtype="float32", dtype="bfloat16", remat="full",
                   attention_impl="ring" if ring else "blockwise", moe_dispatch="capacity")
    c.seq_len, c.batch = shape["seq_len"], shape["batch"]
    c.layout = "zigzag" if ring else "contiguous"
    c.budget_gib = 95.0
    c.search.device_counts = shape["device_counts"]
    c.mesh.update(expert=8 if ring else 64, fsdp=1 if ring else 4)
    c.lock()
    return c
