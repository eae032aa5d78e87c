"""Ring attention forward+backward: ptrain's vs the `ringattention` package, same inputs, same run.

    bench/.venv-ring/bin/python bench/ring_bench.py            # S = 8192 and 32768
    bench/.venv-ring/bin/python bench/ring_bench.py --lengths 4096 --reps 1

Set-up of the bench-only environment (git-ignored; it reuses the installed JAX):
    python -m venv --system-site-packages bench/.venv-ring
    bench/.venv-ring/bin/pip install --no-deps ringattention==0.1.2 einops

8 simulated CPU devices, B=1, 4 heads, head dim 64, causal, float32. The peer's package
`__init__` fails on current JAX (`jax.lib.xla_bridge` is gone), so its `ringattention_jax.py`
is loaded by file path; the peer has no GQA and no load balancing (contiguous layout only) and
needs `check_vma=False`. Prints time and per-device compiled memory with ratios to the peer,
and the error of both against a dense softmax at a small length.
"""

import argparse
import functools
import importlib.util
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import long_context as lc  # noqa: E402

AXIS = "sequence"


def load_peer():
    """The peer's ring_attention, or the reason it cannot be loaded."""
    spec = importlib.util.find_spec("ringattention")
    if spec is None:
        return None, "ringattention is not installed (see the set-up in this file's doc)"
    path = os.path.join(list(spec.submodule_search_locations)[0], "ringattention_jax.py")
    module_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # report, then benchmark ours alone
        return None, f"ringattention_jax failed to import: {type(e).__name__}: {e}"
    return module.ring_attention, None


def peer_fn(ring, mesh, block):
    spec = P(None, AXIS)

    def attend(q, k, v):
        chunk = min(block, q.shape[1] // mesh.shape[AXIS])  # its chunks must divide a shard
        kwargs = dict(causal_block_size=1, deterministic=True, dropout_rng=None,
                      attn_pdrop=0.0, query_chunk_size=chunk, key_chunk_size=chunk,
                      dtype=jnp.float32, policy=jax.checkpoint_policies.nothing_saveable,
                      precision=None, prevent_cse=True)
        body = functools.partial(ring, axis_name=AXIS, float32_logits=True,
                                 blockwise_kwargs=kwargs)
        bias = jnp.zeros((q.shape[0], 1, 1, q.shape[1]), jnp.float32)
        sm = jax.shard_map(lambda q, k, v, bias: body(q, k, v, bias, None, None), mesh=mesh,
                           in_specs=(spec, spec, spec, P(None, None, None, AXIS)),
                           out_specs=spec, check_vma=False)
        return sm(q, k, v, bias)

    return attend


def ours_fn(mesh, block, layout):
    n = mesh.shape[AXIS]

    def attend(q, k, v):
        t = q.shape[1]
        pos = jnp.broadcast_to(jnp.asarray(lc.layout_permutation(t, layout, n)), q.shape[:2])
        # Inputs are taken as already in `layout` (reordered once per batch in the pipeline).
        return lc.ring_attention(q, k, v, mesh=mesh, positions=pos, block_q=block,
                                 block_k=block)

    return attend


def measure(candidates, args, reps):
    """{name: (median seconds, per-device bytes)}; reps interleave the candidates, so load
    from other processes hits all of them alike."""
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


def inputs(mesh, b, t, h, d, dtype, seed=0):
    sharding = NamedSharding(mesh, P(None, AXIS))
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.device_put(jax.random.normal(k, (b, t, h, d), jnp.float32).astype(dtype),
                           sharding) for k in keys]


def accuracy(candidates, mesh, t, h, d):
    """Max abs error of out, dq, dk, dv against jax.nn.dot_product_attention (XLA, dense)."""
    q, k, v = inputs(mesh, 1, t, h, d, jnp.float32, seed=1)
    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="xla")

    def out_and_grads(fn):
        out, vjp = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v))(q, k, v)
        return (out, *vjp(jnp.ones_like(out)))

    ref = out_and_grads(dense)
    return {name: max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(out_and_grads(fn), ref))
            for name, fn in candidates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=512, help="query and key block, both")
    parser.add_argument("--peer_block", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    n = len(jax.devices())
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,))
    peer, why = load_peer()
    print(f"jax {jax.__version__}, {n} {jax.devices()[0].platform} devices, B=1, "
          f"{args.heads} heads, head dim {args.head_dim}, causal, float32")
    candidates = {f"ours-{layout}": ours_fn(mesh, args.block, layout)
                  for layout in ("contiguous", "zigzag")}
    if peer is None:
        print(f"peer not benchmarked: {why}")
    else:
        candidates["peer"] = peer_fn(peer, mesh, args.peer_block)

    small = {name: fn for name, fn in candidates.items() if name != "ours-zigzag"}
    errors = accuracy(small, mesh, 1024, args.heads, args.head_dim)
    for name, err in errors.items():
        print(f"accuracy at S=1024 vs dense: {name}: max abs error {err:.2e}")
    if peer is not None:
        q, k, v = inputs(mesh, 1, 256, 2, 16, jnp.bfloat16)
        for name in ("ours-contiguous", "peer"):
            grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
                candidates[name](q, k, v).astype(jnp.float32)), (0, 1, 2)))(q, k, v)
            print(f"bfloat16 inputs: {name} returns {grads[0].dtype} gradients")

    print(f"\n{'S':>7} {'impl':>16} {'fwd+bwd s':>10} {'vs peer':>8} {'MiB/device':>11} "
          f"{'vs peer':>8}")
    for t in args.lengths:
        x = inputs(mesh, 1, t, args.heads, args.head_dim, jnp.float32)
        results = measure(candidates, x, args.reps)
        base = results.get("peer")
        for name, (secs, mem) in results.items():
            ratio_t = f"{secs / base[0]:.2f}" if base else "-"
            ratio_m = f"{mem / base[1]:.2f}" if base else "-"
            print(f"{t:>7} {name:>16} {secs:>10.3f} {ratio_t:>8} {mem / 2**20:>11.1f} "
                  f"{ratio_m:>8}")


if __name__ == "__main__":
    main()
