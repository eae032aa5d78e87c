"""Programs that tests run both in one process x 8 devices and in N processes (multiprocess.py).

Each returns plain numpy / Python values so the two runs can be compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ptrain import sharding


def helpers(rows: int = 16) -> dict:
    """sharding's global-array helpers on three meshes: batch over all devices, over fsdp=2
    (tensor=4 inside a process), and replicated (tensor over all devices)."""
    out = {"process": jax.process_index(), "count": jax.process_count()}
    x_bt = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    lengths_b = np.arange(rows, dtype=np.int32) % 5
    for name, mesh in [("fsdp", sharding.make_mesh(fsdp=-1)),
                       ("fsdp2", sharding.make_mesh(fsdp=2, tensor=-1)),
                       ("tensor", sharding.make_mesh(fsdp=1, tensor=-1))]:
        rs = sharding.local_rows(mesh, rows)
        x, lengths = sharding.from_process_local((x_bt[rs], lengths_b[rs]), mesh,
                                                 global_rows=rows)
        y = jax.jit(lambda a, n: a * 2.0 + a.sum() + n[:, None])(x, lengths)
        out[name] = {"rows": (rs.start, rs.stop), "whole": sharding.to_host(y),
                     "local": sharding.to_host_local(y),
                     "sum": float(sharding.to_host(jnp.sum(y)))}
        # Without global_rows: inferred from how many processes hold different rows.
        again = sharding.from_process_local(x_bt[rs], mesh, axes=("batch", None))
        out[name]["inferred_shape"] = tuple(again.shape)
    # Host values that differ per process, agreed before they steer control flow.
    mine = 3 + 4 * jax.process_index()
    out["max"] = sharding.agree(mine, "max")
    out["min"] = sharding.agree(mine, "min")
    out["sum"] = sharding.agree(mine, "sum")
    out["any"] = sharding.agree(jax.process_index() == 1, "any")
    out["all"] = sharding.agree(jax.process_index() == 1, "all")
    out["vec"] = sharding.agree(np.array([mine, -mine]), "max")
    out["equal"] = sharding.agree(7, "equal")
    try:
        sharding.agree(mine, "equal")
        out["equal_error"] = None
    except ValueError as e:
        out["equal_error"] = str(e)
    return out


def fails_on_one() -> None:
    """Process 1 raises; the harness must report it instead of waiting on process 0."""
    if jax.process_index() == 1:
        1 / 0
    sharding.agree(1, "max")  # process 0 waits here for process 1, which is gone


SAMPLER_PROMPTS = [[1, 5, 9, 33, 2], [1, 7], [1, 40, 41, 12, 3, 3, 18, 30, 22, 9, 11], [4],
                   [1, 2, 3], [9, 9, 9, 9], [1, 30], [17, 2, 5, 6, 7, 8]]


def _decode_chars(ids):
    return "".join(chr(97 + i % 26) for i in ids)


def sampler_program() -> dict:
    """The sampler with each process passing its own prompts (rows over fsdp): random
    samples with an explicit key, greedy ones with stop strings (a host loop whose stops are
    agreed across processes). One prefill compilation, two decode ones."""
    from flax import nnx

    from ptrain import model as M
    from ptrain import sampler as S
    config = M.ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                           d_ff=64)
    n, p = jax.process_count(), jax.process_index()
    k = len(SAMPLER_PROMPTS) // n
    prompts = SAMPLER_PROMPTS[p * k:(p + 1) * k]
    model = M.init(config, seed=3, mesh=sharding.make_mesh(fsdp=-1))
    params = nnx.state(model)
    sampler = S.Sampler(model, decode=_decode_chars, stop_check_every=3)
    a = sampler.sample(params, prompts, max_new_tokens=8, num_samples=2, temperature=0.8,
                       key=jax.random.key(7))
    b = sampler.sample(params, prompts, max_new_tokens=8, num_samples=2, greedy=True,
                       stop_strings=("c", "f", "k", "p"))
    return {k: (s.tokens, s.logp, s.logp_t1, s.lengths, s.finish_reasons, s.prompt_index)
            for k, s in (("random", a), ("stops", b))}


def checkpoint_program(directory: str, save: bool) -> dict:
    """Save step 5 (arrays over fsdp, each process its own data state) and restore it onto
    another mesh; or only restore what another process count saved."""
    import optax

    from ptrain.checkpoint import Checkpointer
    mesh = sharding.make_mesh(fsdp=-1)
    other = sharding.make_mesh(fsdp=2, tensor=-1)
    rows = sharding.local_rows(mesh, 16)
    w = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    params = {"w_dv": sharding.from_process_local(w[rows], mesh, axes=("batch", None),
                                                  global_rows=16),
              "b": jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(
                  mesh, jax.sharding.PartitionSpec()))}
    opt_state = optax.adam(0.1).init(params)
    rng = jax.random.key(3)
    out = {}
    with Checkpointer(directory, max_to_keep=2) as ckpt:
        if save:
            grads = jax.tree.map(jnp.ones_like, params)
            updates, opt_state = optax.adam(0.1).update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            ckpt.save(5, params=params, opt_state=opt_state, rng=jax.random.fold_in(rng, 5),
                      data_state={"pos": 10 + jax.process_index()}, extra={"kl": 0.5})
            ckpt.wait()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.named(
            other, ("batch", None)[:x.ndim], x.shape)), (params, opt_state))
    with Checkpointer(directory) as ckpt:
        restored = ckpt.restore(params=target[0], opt_state=target[1], rng=rng)
    out["step"], out["extra"], out["data_state"] = restored.step, restored.extra, \
        restored.data_state
    out["specs"] = [tuple(x.sharding.spec) for x in jax.tree.leaves(restored.params)]
    out["values"] = sharding.to_host((restored.params, restored.opt_state))
    out["rng"] = np.asarray(jax.random.key_data(restored.rng))
    return out
