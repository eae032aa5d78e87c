"""ptrain.checkpoint: round trip, keep-N, named aux state, host arrays, resharding on
restore, SIGKILL mid-save."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from ptrain.checkpoint import Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def state_at(step, sharding=None):
    params = {"w_dv": jnp.full((8, 4), float(step)), "b": jnp.arange(4.0) + step}
    if sharding is not None:
        params = jax.device_put(params, {"w_dv": sharding, "b": jax.sharding.NamedSharding(
            sharding.mesh, P())})
    opt_state = optax.adamw(1e-3).init(params)
    return params, opt_state


def test_round_trip_keep_n_and_latest(tmp_path):
    rng = jax.random.key(7)
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            ckpt.restore(params={}, opt_state={}, rng=rng)
        for step in range(1, 5):
            params, opt_state = state_at(step)
            opt_state = jax.tree.map(lambda x: x + step if x.dtype == jnp.float32 else x,
                                     opt_state)
            ckpt.save(step, params=params, opt_state=opt_state, rng=jax.random.fold_in(rng, step),
                      data_state={"next_index": 10 * step}, extra={"kl_coef": 0.1 * step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    params, opt_state = state_at(0)
    with Checkpointer(tmp_path) as ckpt:  # a fresh process would do the same
        out = ckpt.restore(params=params, opt_state=opt_state, rng=rng)
        older = ckpt.restore(3, params=params, opt_state=opt_state, rng=rng)
        abstract = jax.eval_shape(lambda: (params, opt_state, rng))  # targets need no arrays
        from_abstract = ckpt.restore(params=abstract[0], opt_state=abstract[1], rng=abstract[2])
    assert out.step == 4 and older.step == 3
    np.testing.assert_array_equal(out.params["w_dv"], np.full((8, 4), 4.0))
    np.testing.assert_array_equal(out.opt_state[0].mu["b"], np.full(4, 4.0))
    assert out.data_state == {"next_index": 40} and older.extra == {"kl_coef": 0.1 * 3}
    np.testing.assert_array_equal(jax.random.key_data(out.rng),
                                  jax.random.key_data(jax.random.fold_in(rng, 4)))
    assert jax.random.key_impl(out.rng) == jax.random.key_impl(rng)
    assert jax.tree.structure(out.opt_state) == jax.tree.structure(opt_state)
    for a, b in zip(jax.tree.leaves((from_abstract.params, from_abstract.opt_state)),
                    jax.tree.leaves((out.params, out.opt_state))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.random.key_data(from_abstract.rng),
                                  jax.random.key_data(out.rng))


def test_aux_state_round_trip_and_mismatch(tmp_path):
    """Named pytrees next to the parameters (the PPO critic) come back by name; a restore
    that asks for other names than were saved fails and says what to do."""
    rng = jax.random.key(0)
    params, opt_state = state_at(1)
    critic_params, critic_opt = state_at(9)
    with Checkpointer(tmp_path / "with") as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, rng=rng,
                  aux_state={"critic": {"params": critic_params, "opt_state": critic_opt}})
        ckpt.wait()
    with Checkpointer(tmp_path / "without") as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, rng=rng)
        ckpt.wait()
    target = {"critic": {"params": state_at(0)[0], "opt_state": state_at(0)[1]}}
    with Checkpointer(tmp_path / "with") as ckpt:
        out = ckpt.restore(params=params, opt_state=opt_state, rng=rng, aux_state=target)
        with pytest.raises(ValueError, match=r"holds aux state \['critic'\] but the restore "
                                             r"asks for \[\]"):
            ckpt.restore(params=params, opt_state=opt_state, rng=rng)
    np.testing.assert_array_equal(out.aux_state["critic"]["params"]["w_dv"], np.full((8, 4), 9.0))
    assert (jax.tree.structure(out.aux_state["critic"]["opt_state"])
            == jax.tree.structure(critic_opt))
    np.testing.assert_array_equal(out.params["w_dv"], np.full((8, 4), 1.0))
    with Checkpointer(tmp_path / "without") as ckpt:
        assert ckpt.restore(params=params, opt_state=opt_state, rng=rng).aux_state == {}
        with pytest.raises(ValueError, match="rl.estimator='gae' saves its critic"):
            ckpt.restore(params=params, opt_state=opt_state, rng=rng, aux_state=target)


def test_host_state_round_trip_as_numpy(tmp_path):
    """Host arrays (rl.interrupt's finished batches) come back exact, as numpy, with their
    dtypes and shapes (a zero-size one too, which orbax cannot save) and no target given;
    a checkpoint without them restores an empty host_state; a non-array leaf is refused."""
    rng = jax.random.key(0)
    params, opt_state = state_at(1)
    host = {"ahead_batches": {
        "0": {"tokens_bn": np.arange(12, dtype=np.int32).reshape(3, 4),
              "logp_bn": np.linspace(-3, 0, 12, dtype=np.float32).reshape(3, 4),
              "experts_bnlk": np.ones((3, 4, 2, 2), np.int8)},
        "1": {"tokens_bn": np.zeros((2, 0), np.int32)}}}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, params=params, opt_state=opt_state, rng=rng, host_state=host)
        ckpt.save(2, params=params, opt_state=opt_state, rng=rng)
        with pytest.raises(TypeError, match=r"host_state.ahead_batches.0.meta: nested dicts "
                                            r"of numpy arrays only, not list"):
            ckpt.save(3, params=params, opt_state=opt_state, rng=rng,
                      host_state={"ahead_batches": {"0": {"meta": [{}]}}})
        ckpt.wait()
    with Checkpointer(tmp_path) as ckpt:
        out = ckpt.restore(1, params=params, opt_state=opt_state, rng=rng)
        assert ckpt.restore(2, params=params, opt_state=opt_state, rng=rng).host_state == {}
    got = out.host_state["ahead_batches"]
    assert sorted(got) == ["0", "1"] and sorted(got["0"]) == sorted(host["ahead_batches"]["0"])
    for name in ("0", "1"):
        for field, want in host["ahead_batches"][name].items():
            assert type(got[name][field]) is np.ndarray
            assert got[name][field].dtype == want.dtype
            np.testing.assert_array_equal(got[name][field], want)
    np.testing.assert_array_equal(out.params["w_dv"], np.full((8, 4), 1.0))


def test_restore_onto_a_different_sharding(tmp_path):
    devices = np.array(jax.devices()[:8])
    save_sharding = NamedSharding(jax.sharding.Mesh(devices, ("fsdp",)), P("fsdp", None))
    params, opt_state = state_at(5, save_sharding)
    raw_key = jax.random.PRNGKey(1)  # raw uint32 keys work too
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, params=params, opt_state=opt_state, rng=raw_key)
        ckpt.wait()
    mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("fsdp", "tensor"))
    target_sharding = NamedSharding(mesh, P("tensor", "fsdp"))
    abstract = jax.eval_shape(lambda: state_at(0))
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, P()) if x.ndim < 2 else
                             target_sharding, abstract)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          abstract, shardings)
    with Checkpointer(tmp_path) as ckpt:
        out = ckpt.restore(params=target[0], opt_state=target[1], rng=raw_key)
    assert out.params["w_dv"].sharding == target_sharding
    assert out.opt_state[0].nu["w_dv"].sharding == target_sharding
    np.testing.assert_array_equal(out.params["w_dv"], np.full((8, 4), 5.0))
    np.testing.assert_array_equal(out.rng, raw_key)


# The child saves step 1 and waits for it, then starts step 2. In "commit" mode the final
# rename of step 2 is held (its arrays are all written) and the child reports it; in "write"
# mode it reports as soon as the asynchronous save has started, while arrays are being written.
CHILD = textwrap.dedent("""
    import asyncio, sys
    import jax.numpy as jnp, jax
    from orbax.checkpoint._src.path import atomicity
    from ptrain.checkpoint import Checkpointer

    mode, directory = sys.argv[1], sys.argv[2]
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held_finalize(self):
        if self.get().name.startswith("2."):
            print("holding commit of 2", flush=True)
            await asyncio.to_thread(sys.stdin.read)  # never returns: the parent kills us
        return await finalize(self)

    if mode == "commit":
        atomicity.AtomicRenameTemporaryPath.finalize = held_finalize
    ckpt = Checkpointer(directory)
    for step in (1, 2):
        params = {"w": jnp.full((512, 1024), float(step)), "v": jnp.full((256, 1024), -step)}
        ckpt.save(step, params=params, opt_state={"m": params["v"] * 2}, rng=jax.random.key(step),
                  data_state={"next_index": step})
        if step == 1:
            ckpt.wait()
    print("saving 2", flush=True)
    sys.stdin.read()
""")


@pytest.mark.parametrize("mode", ["commit", "write"])
def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path, mode):
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(tmp_path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        wanted = "holding commit of 2" if mode == "commit" else "saving 2"
        for line in child.stdout:
            if line.strip() == wanted:
                break
        else:
            pytest.fail(f"child exited ({child.wait()}) before reaching {wanted!r}")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    if mode == "commit":  # killed with step 2 fully written but not committed
        assert any(n.startswith("2.") and "tmp" in n for n in os.listdir(tmp_path))
    target = {"w": jnp.zeros((512, 1024)), "v": jnp.zeros((256, 1024))}
    with Checkpointer(tmp_path) as ckpt:
        step = ckpt.latest_step()
        assert step == 1 if mode == "commit" else step in (1, 2)
        out = ckpt.restore(params=target, opt_state={"m": target["v"]}, rng=jax.random.key(0))
        # Whichever step is latest is complete and consistent.
        np.testing.assert_array_equal(out.params["w"], np.full((512, 1024), float(step)))
        np.testing.assert_array_equal(out.opt_state["m"], np.full((256, 1024), -2.0 * step))
        assert out.data_state == {"next_index": step}
        # The resumed run saves the step that was cut short again.
        ckpt.save(step + 1, params=target, opt_state={"m": target["v"]}, rng=jax.random.key(3))
        ckpt.wait()
        assert ckpt.latest_step() == step + 1
