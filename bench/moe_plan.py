"""Memory plans for MoE models: compile `ptrain.plan`'s training step on simulated devices.

Shapes from the public config.json files: Qwen/Qwen3-30B-A3B, and a Kimi-K2-class model
(moonshotai/Kimi-K2-Instruct: 61 layers, d 7168, 384 experts of 2048, 8 active, 1 shared
expert, layer 0 dense with 18432). Kimi K2's attention is MLA, which ptrain does not have: the
plan uses grouped-query attention with 64 query and 8 kv heads of 128, about the same
parameters. Capacity dispatch (factor 1.25): on XLA's CPU compiler `ragged_dot` is a masked
dense matmul over all experts, whose buffers say nothing about a GPU or TPU.

    python bench/moe_plan.py --model qwen3-30b-a3b --seq 32768 --batch 1 \
        --meshes '[{"sequence": 8}, {"sequence": 4, "expert": 2}]'
    python bench/moe_plan.py --model kimi-k2 --seq 4096 --batch 256 \
        --meshes '[{"expert": 64, "fsdp": 4}, {"expert": 64, "fsdp": 8}]'

Given meshes only; the mesh search over every axis, the expert one included, is
`python -m launch.plan --config=configs/moe_plan.py[:kimi-k2] --search`.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from configs.moe_plan import MODELS  # noqa: E402 (the shapes, as launch.plan's search uses them)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--meshes", required=True, help="JSON list of mesh dicts")
    args = parser.parse_args()
    meshes = json.loads(args.meshes)
    devices = max(math.prod(m.values()) for m in meshes)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import ml_collections
    from ptrain import model as model_lib
    from ptrain import moe
    from ptrain import plan

    ring = any(m.get("sequence", 1) > 1 for m in meshes)
    mc = model_lib.ModelConfig(
        **MODELS[args.model], param_dtype="float32", dtype="bfloat16", remat="full",
        attention_impl="ring" if ring else "blockwise", moe_dispatch="capacity")
    optim = ml_collections.ConfigDict(dict(
        lr=1e-5, warmup_steps=0, schedule="constant", min_lr_ratio=0.0, weight_decay=0.0,
        b1=0.9, b2=0.95, eps=1e-8, grad_clip=1.0))
    gib = 1 << 30
    print(f"{args.model}: {mc.n_params / 1e9:.1f}B parameters, {mc.n_active_params / 1e9:.1f}B "
          f"active; {args.batch} x {args.seq} tokens per step", flush=True)
    for mesh in meshes:
        r = plan.compile_plan(mc, mesh, seq_len=args.seq, batch=args.batch, optim=optim,
                              chunk=1024, layout="zigzag" if ring else "contiguous")
        m = r["memory"]
        # All-to-all payload per device per step (capacity buffers: [E, C, d] in the compute
        # dtype, each crossing the expert axis twice per forward; forward, remat recompute
        # and backward: 6 times per MoE layer), the part that leaves the device.
        ep = int(mesh.get("expert", 1))
        tokens = args.batch * args.seq / math.prod(mesh.values())
        buffer = mc.n_experts * moe.capacity(int(tokens), mc) * mc.d_model * 2
        a2a = 6 * moe.n_moe_layers(mc) * buffer * (ep - 1) / ep
        print(json.dumps({
            "mesh": r["mesh"], "devices": r["devices"],
            "peak_gib": round(m["peak"] / gib, 1),
            "params_gib": round(r["params_bytes"] / gib, 1),
            "adam_gib": round(r["opt_state_bytes"] / gib, 1),
            "temporaries_gib": round(m["temporaries"] / gib, 1),
            "fits_v5p_95": m["peak"] <= 95 * gib, "fits_h200_141": m["peak"] <= 141 * gib,
            "model_flops_per_token": r["model_flops"] / (args.batch * args.seq),
            "all_to_all_gib_per_device_step": round(a2a / gib, 1),
            "compile_s": r["compile_s"]}), flush=True)


if __name__ == "__main__":
    main()
