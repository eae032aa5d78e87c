"""Blockwise attention vs dense attention on one device: forward+backward time and memory.

    python bench/blockwise_bench.py                      # lengths 1K..16K, dense up to 8K
    python bench/blockwise_bench.py --sweep 4096         # also sweep block sizes at t=4096

The baseline is `jax.nn.dot_product_attention(implementation="xla")`, JAX's dense attention,
measured in the same run. B=1, 4 heads (GQA with 4 query heads per kv head is --kv_heads 1),
head dim 64, causal, float32. Memory is the compiled per-device total (temp + arguments +
outputs) of the fused forward+backward step.
"""

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import long_context as lc  # noqa: E402


def measure(candidates, args, reps):
    """{name: (median seconds, bytes)}; reps interleave the candidates, so load from other
    processes hits all of them alike."""
    steps, mems, times = {}, {}, {name: [] for name in candidates}
    for name, attend in candidates.items():
        loss = lambda q, k, v, attend=attend: jnp.sum(attend(q, k, v).astype(jnp.float32))
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        mem = compiled.memory_analysis()
        mems[name] = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                      + mem.output_size_in_bytes)
        jax.block_until_ready(compiled(*args))  # warm-up
        steps[name] = compiled
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), mems[name]) for name in candidates}


def inputs(t, heads, kv_heads, head_dim, dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(1, t, heads, head_dim), (1, t, kv_heads, head_dim), (1, t, kv_heads, head_dim)]
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+",
                        default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dense_max", type=int, default=8192, help="longest dense run")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--block_q", type=int, default=512)
    parser.add_argument("--block_k", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sweep", type=int, default=0, help="sweep block sizes at this length")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)

    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="xla")
    ours = lambda bq, bk: lambda q, k, v: lc.blockwise_attention(q, k, v, block_q=bq,
                                                                 block_k=bk)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, B=1, {args.heads} heads, "
          f"{args.kv_heads} kv heads, head dim {args.head_dim}, causal, {args.dtype}, "
          f"blocks {args.block_q}x{args.block_k}")
    print(f"{'t':>7} {'dense s':>9} {'blockwise s':>12} {'speed-up':>9} {'dense MiB':>10} "
          f"{'blockwise MiB':>14} {'mem ratio':>10}")
    for t in args.lengths:
        x = inputs(t, args.heads, args.kv_heads, args.head_dim, dtype)
        candidates = {"blockwise": ours(args.block_q, args.block_k)}
        if t <= args.dense_max:
            candidates["dense"] = dense
        results = measure(candidates, x, args.reps)
        secs, mem = results["blockwise"]
        if "dense" in results:
            d_secs, d_mem = results["dense"]
            print(f"{t:>7} {d_secs:>9.3f} {secs:>12.3f} {d_secs / secs:>9.2f} "
                  f"{d_mem / 2**20:>10.1f} {mem / 2**20:>14.1f} {d_mem / mem:>10.1f}")
        else:
            print(f"{t:>7} {'-':>9} {secs:>12.3f} {'-':>9} {'-':>10} {mem / 2**20:>14.1f} "
                  f"{'-':>10}")

    if args.sweep:
        x = inputs(args.sweep, args.heads, args.kv_heads, args.head_dim, dtype)
        sizes = [64, 128, 256, 512, 1024]
        results = measure({(bq, bk): ours(bq, bk) for bq, bk in itertools.product(sizes, sizes)},
                          x, args.reps)
        base = results[(args.block_q, args.block_k)][0]
        print(f"\nblock sweep at t={args.sweep}: fwd+bwd seconds (ratio to "
              f"{args.block_q}x{args.block_k})")
        print("block_q \\ block_k " + "".join(f"{bk:>14}" for bk in sizes))
        for bq in sizes:
            cells = "".join(f"{results[(bq, bk)][0]:>7.3f} ({results[(bq, bk)][0] / base:.2f})"
                            for bk in sizes)
            print(f"{bq:>18} {cells}")


if __name__ == "__main__":
    main()
