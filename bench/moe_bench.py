"""The MoE layer's forward+backward tokens/s: dispatches against each other, expert=8 vs 1.

One Qwen3-MoE-style block (`ptrain.moe.block`: router, top-k, SwiGLU experts) on a batch of
tokens, d(sum of outputs^2)/d(inputs, weights) per step. Dispatches: dropless (sorted tokens,
`jax.lax.ragged_dot` grouped matmuls), capacity (fixed [experts, C] buffers, batched matmuls)
and dense (every token through every expert: the baseline). Meshes: all devices on fsdp with
experts replicated (expert=1), and experts sharded with all-to-all dispatch (expert=N).
Ratios are against dense on expert=1, measured in the same run with repetitions interleaved.

    python bench/moe_bench.py [--devices 8 --tokens 8192 --d 512 --f 256 --experts 8 --k 2]
    python bench/moe_bench.py --devices 1 --dtype bfloat16   # one accelerator
"""

import argparse
import os
import sys


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (0: the "
                        "machine's own devices, e.g. a GPU)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--f", type=int, default=256, help="expert hidden size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


ARGS = _parse()
if ARGS.devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ptrain import model as model_lib  # noqa: E402
from ptrain import moe  # noqa: E402
from ptrain import sharding  # noqa: E402


def _step(config, mesh, p, h_btd, valid_bt):
    def loss(p, h):
        y, _ = moe.block(p, h, valid_bt, config, mesh)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main():
    a = ARGS
    n_dev = len(jax.devices())
    base = model_lib.ModelConfig(
        vocab_size=8, d_model=a.d, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=8,
        n_experts=a.experts, n_experts_per_token=a.k, d_ff_expert=a.f, norm_topk_prob=True,
        moe_capacity_factor=a.capacity_factor, dtype=a.dtype, param_dtype=a.dtype)
    dt = jnp.dtype(a.dtype)
    rng = np.random.RandomState(0)
    seq = 512
    b = a.tokens // seq
    weights = {
        "router": rng.randn(a.d, a.experts) / np.sqrt(a.d),
        "w_gate": rng.randn(a.experts, a.d, a.f) / np.sqrt(a.d),
        "w_up": rng.randn(a.experts, a.d, a.f) / np.sqrt(a.d),
        "w_down": rng.randn(a.experts, a.f, a.d) / np.sqrt(a.f)}
    weights = {k: jnp.asarray(v, dt) for k, v in weights.items()}
    h = jnp.asarray(rng.randn(b, seq, a.d), dt)
    valid = jnp.ones((b, seq), jnp.int32)
    axes = {"router": (None, None), "w_gate": ("experts", "embed", "mlp"),
            "w_up": ("experts", "embed", "mlp"), "w_down": ("experts", "mlp", "embed")}

    meshes = {"expert=1": sharding.make_mesh(fsdp=-1)}
    if n_dev > 1 and a.experts % n_dev == 0:
        meshes[f"expert={n_dev}"] = sharding.make_mesh(fsdp=1, expert=n_dev)
    runs = {}
    for mesh_name, mesh in meshes.items():
        p = {k: jax.device_put(v, sharding.named(mesh, axes[k], v.shape))
             for k, v in weights.items()}
        x = sharding.shard_batch(h, mesh, ("batch", "seq", None))
        m = sharding.shard_batch(valid, mesh)
        for dispatch in moe.DISPATCHES:
            c = base.replace(moe_dispatch=dispatch)
            fn = _step(c, mesh, p, x, m)
            runs[(dispatch, mesh_name)] = (lambda fn=fn, p=p, x=x: jax.block_until_ready(
                fn(p, x)))
    start = time.perf_counter()
    for run in runs.values():
        run()  # compile
    print(f"compiled {len(runs)} steps in {time.perf_counter() - start:.0f}s")
    times = {key: [] for key in runs}
    for _ in range(a.repeats):
        for key, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - t0)
    baseline = np.median(times[("dense", "expert=1")])
    print(f"{n_dev} {jax.devices()[0].platform} device(s), {a.tokens} tokens, d={a.d}, "
          f"expert f={a.f}, {a.experts} experts, top-{a.k}, {a.dtype}, fwd+bwd of one "
          f"MoE block, median of {a.repeats} (min-max)")
    print(f"{'dispatch':10s} {'mesh':10s} {'ms':>9s} {'tokens/s':>10s} {'vs dense e=1':>13s}")
    for (dispatch, mesh_name), ts in times.items():
        med = float(np.median(ts))
        print(f"{dispatch:10s} {mesh_name:10s} {med * 1e3:9.1f} {a.tokens / med:10.0f} "
              f"{baseline / med:12.2f}x   ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
