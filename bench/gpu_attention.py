"""Blockwise and ring attention forward+backward at 128K tokens: achieved TFLOP/s vs matmul peak.

    python bench/gpu_attention.py                      # on a GPU: 128K tokens, bfloat16
    python bench/gpu_attention.py --blocks 1024 2048 4096
    python bench/gpu_attention.py --tiny               # a smoke run that fits a CPU

The peak is a large bfloat16 matmul timed in the same run. FLOPs are the useful ones of causal
attention (half the score matrix): forward 4*b*h*t^2*d/2, forward+backward 3.5x that (the
backward does 5 matmuls to the forward's 2). The ring runs over every local device with the
zigzag layout (on one GPU it is a ring of one, i.e. the same kernel plus the ring's
bookkeeping). On GPU, cuDNN flash attention (`jax.nn.dot_product_attention`,
implementation="cudnn") is measured too when it supports the shapes.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import long_context as lc


def timed(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(n, dtype, reps):
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
    return 2 * n**3 / timed(f, (a, a), reps) / 1e12


def fwd_bwd(attend):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048],
                        help="query = key block sizes to try")
    parser.add_argument("--peak_n", type=int, default=8192, help="matmul size for the peak")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run")
    args = parser.parse_args()
    if args.tiny:
        args.tokens, args.heads, args.kv_heads, args.head_dim = 1024, 4, 1, 32
        args.blocks, args.peak_n, args.reps = [128, 256], 1024, 1

    dtype = jnp.dtype(args.dtype)
    devices = jax.devices()
    b, t, h, kh, d = args.batch, args.tokens, args.heads, args.kv_heads, args.head_dim
    flops = 3.5 * 4 * b * h * t * t * d / 2
    peak = matmul_peak(args.peak_n, dtype, args.reps)
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}; b={b} t={t} h={h} "
          f"kv={kh} d={d} {args.dtype} causal; matmul peak {peak:.1f} TFLOP/s "
          f"({args.peak_n}^3)")
    print(f"{'impl':>22} {'fwd+bwd s':>10} {'TFLOP/s/dev':>12} {'of peak':>8}")

    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, t, kh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, kh, d), jnp.float32).astype(dtype)

    def report(name, secs, n_dev=1):
        tflops = flops / n_dev / secs / 1e12
        print(f"{name:>22} {secs:>10.3f} {tflops:>12.3g} {tflops / peak:>8.1%}", flush=True)

    for block in args.blocks:
        attend = lambda q, k, v: lc.blockwise_attention(q, k, v, block_q=block, block_k=block)
        report(f"blockwise {block}", timed(fwd_bwd(attend), (q, k, v), args.reps))

    n = len(devices)
    mesh = jax.make_mesh((n,), ("sequence",), axis_types=(AxisType.Explicit,))
    pos = jnp.broadcast_to(jnp.asarray(lc.layout_permutation(t, "zigzag", n)), (b, t))
    sharded = [jax.device_put(lc.reorder(x, "zigzag", n), NamedSharding(mesh, P(None, "sequence")))
               for x in (q, k, v)]
    pos = jax.device_put(pos, NamedSharding(mesh, P(None, "sequence")))
    for block in args.blocks:
        attend = lambda q, k, v: lc.ring_attention(q, k, v, mesh=mesh, positions=pos,
                                                   block_q=block, block_k=block)
        report(f"ring x{n} zigzag {block}", timed(fwd_bwd(attend), sharded, args.reps), n)

    if devices[0].platform == "gpu":
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation="cudnn")
        try:
            report("cudnn (jax.nn)", timed(fwd_bwd(attend), (q, k, v), args.reps))
        except Exception as e:  # shapes or versions cuDNN does not take: say so, go on
            print(f"{'cudnn (jax.nn)':>22} unavailable: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
