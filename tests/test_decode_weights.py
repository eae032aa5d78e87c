"""sampling.decode_dtype="bfloat16": the engine decodes its own bfloat16 copy of the policy
(ptrain.generate.decode_weights), resharded for decoding and refreshed when the parameters change.
References: the bfloat16 model's own teacher-forced forward, and XLA's compiled decode
program (which collectives it runs over which devices)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ptrain import config as config_lib
from ptrain import model as M
from ptrain import rollout
from ptrain import sharding
from ptrain.generate import decode_weights
from ptrain.generate import engine_sampler
from ptrain.generate import kv_slots

# The learner's default attention ("blockwise"): the engine's decode attention is the same
# online softmax, so in bfloat16 it rounds where the model's forward does.
CONFIG = M.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       qkv_bias=True, attention_impl="blockwise")
PROMPTS = [[1, 5, 9, 33, 2], [1, 40, 41, 12, 3, 3, 18, 30, 22, 9, 11], [1, 8, 8]]
BF16 = jnp.dtype(jnp.bfloat16)


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(fsdp=4, tensor=2)


@pytest.fixture(scope="module")
def model(mesh):
    """The model born FSDP-sharded (fsdp=4 x tensor=2), its matrices doubled so that its
    distributions are far from uniform and bfloat16 rounding shows in the log-probs."""
    model = M.init(CONFIG, seed=3, mesh=mesh)
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 2 if x.ndim > 1 else x, state))


def _sampler(model):
    config = config_lib.defaults()
    config.sampling.update(engine=True, engine_slots=2, decode_dtype="bfloat16")
    return rollout.make_sampler(model, config)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _teacher_forced(model, prompt, completion):
    """log p(completion[i] | prefix) from one forward of the whole sequence (float64 softmax)."""
    tokens = np.zeros((1, 32), np.int32)
    seq = list(prompt) + list(completion)
    tokens[0, :len(seq)] = seq
    x = np.asarray(_forward(model, tokens), np.float64)[0]
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    at = np.arange(len(prompt), len(seq))
    return logp[at - 1, np.asarray(seq)[at]], logp[at - 1].argmax(-1)


def _bf16_model(model, like):
    """The model in bfloat16 (weights and compute), built from its own config, its weights
    cast from the model's and placed as the arrays of `like` are (the decode copy's
    shardings: with the model dim whole, a matmul's partial sums over `tensor` are added
    across devices, which rounds in bfloat16 unlike one device's sum: 4e-3 apart here)."""
    c = dataclasses.replace(model.config, dtype="bfloat16", param_dtype="bfloat16")
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: M.Transformer(c, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.tree.map(lambda x, y: jax.device_put(x.astype(BF16),
                                                                        y.sharding),
                                            nnx.state(model), like))


def test_bf16_copy_decodes_as_the_bf16_model_and_is_refreshed(model):
    sampler = _sampler(model)
    assert isinstance(sampler, engine_sampler.EngineSampler) and sampler.decode_dtype == "bfloat16"
    # the learner's kind of parameters: a state of its own (nnx.jit calls on `model` below
    # put new arrays in the model's variables, which a state of them would share)
    params = jax.tree.map(lambda x: x, nnx.state(model))
    kw = dict(max_new_tokens=12, greedy=True, prompt_len=16)
    out = sampler.sample(params, PROMPTS, **kw)
    bf16, worst_f32 = _bf16_model(model, sampler.weights.params), 0.0
    for r, prompt in enumerate(PROMPTS):
        completion = out.completions()[r]
        assert len(completion) == 12
        want, argmax = _teacher_forced(bf16, prompt, completion)
        # the engine's bf16 decode equals the bf16 model's teacher-forced forward (measured
        # 2e-7 at most on CPU, 8 simulated devices), greedy tokens are its argmax ...
        np.testing.assert_allclose(out.logp_t1[r], want, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(completion, argmax)
        # ... not the float32 model's (the same weights unrounded: measured 4e-2)
        worst_f32 = max(worst_f32, np.abs(out.logp_t1[r] - _teacher_forced(
            model, prompt, completion)[0]).max())
    assert worst_f32 > 1e-3, worst_f32
    w = sampler.weights
    assert w.syncs == 1 and w.current(params)
    sampler.sample(params, PROMPTS[:1], **kw)  # the same parameters: no new sync
    assert w.syncs == 1
    # an update: new arrays, so the next call syncs and decodes the new weights. (Two rows:
    # a row decoding alone runs matrix-vector products, which round differently in bfloat16
    # from the forward's matrix products: measured 2e-3 on these weights with PROMPTS[:1].)
    new = jax.tree.map(lambda x: x * 1.5, params)
    again = sampler.sample(new, PROMPTS[:2], **kw)
    assert w.syncs == 2 and w.current(new) and not w.current(params)
    for got, want in zip(jax.tree.leaves(w.params), jax.tree.leaves(new)):
        assert got.dtype == BF16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(BF16)))
    np.testing.assert_allclose(again.logp_t1[0], _teacher_forced(
        _bf16_model(nnx.merge(nnx.graphdef(model), new), w.params), PROMPTS[0],
        again.completions()[0])[0], atol=1e-5, rtol=0)
    assert sampler.sync_weights(new) > 0 and w.syncs == 3
    assert all(e.params is None for e in sampler.engines.values())  # one copy, the sampler's


def _groups(line: str, n_devices: int) -> list[set]:
    """The device groups of one collective in XLA's HLO text (explicit, iota or mesh form)."""
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
    if m:
        return [set(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))]
    iota = r"\[([\d,]+)\](?:T\(([\d,]+)\))?"
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=" + iota, line)
    if m:
        ids = np.arange(n_devices).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return [set(g) for g in ids.reshape(int(m.group(1)), int(m.group(2))).tolist()]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(" + iota + r"\))? \{([^}]*)\}",
                  line)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        ids = np.arange(n_devices)
        if m.group(2):
            ids = ids.reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        ids = ids.reshape([int(s) for _, s in axes])
        over = [i for i, (a, _) in enumerate(axes) if f"'{a}'" in m.group(4)]
        moved = np.moveaxis(ids, over, range(-len(over), 0))
        return [set(g) for g in moved.reshape(-1, int(np.prod(
            [ids.shape[i] for i in over]))).tolist()]
    if "replica_groups={}" in line or "replica_groups" not in line:
        return [set(range(n_devices))]
    raise ValueError(f"unparsed replica groups: {line[:300]}")


def _specs(state) -> dict:
    """"layers/wq" -> PartitionSpec of each array, one entry per dimension."""
    return {"/".join(str(k.key) for k in path if hasattr(k, "key")):
            P(*x.sharding.spec, *(None,) * (x.ndim - len(x.sharding.spec)))
            for path, x in jax.tree_util.tree_leaves_with_path(state)}


def _collectives(sampler, params, mesh):
    """Each collective of the engine's compiled decode program, with the mesh axes its
    device groups span."""
    [engine] = sampler.engines.values()
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    coords = {int(ids[idx]): idx for idx in np.ndindex(ids.shape)}
    text = kv_slots.decode.lower(
        params, engine.state, jnp.full(2, engine.slots, jnp.int32), jnp.int32(1),
        jnp.int32(1), jnp.int32(0), graphdef=engine.graphdef,
        settings=engine.settings).compile().as_text()
    out = []
    for line in text.splitlines():
        op = re.search(r" (all-reduce|all-gather|reduce-scatter|all-to-all|"
                       r"collective-permute)(-start)?\(", line)
        if op is None:
            continue
        spans = set()
        for group in _groups(line, mesh.size):
            for axis, name in enumerate(mesh.axis_names):
                if len({coords[d][axis] for d in group}) > 1:
                    spans.add(name)
        out.append((op.group(1), spans))
    return out


def test_decode_copy_is_resharded_heads_over_tensor_no_fsdp(model, mesh):
    """The copy's shardings: the model dim whole, heads / MLP / vocab over `tensor`; and in
    the compiled decode program no collective runs over `fsdp` (the learner's FSDP-sharded
    weights, decoded as they are, need collectives over it every token)."""
    sampler = _sampler(model)
    params = nnx.state(model)
    sampler.sample(params, PROMPTS[:1], max_new_tokens=4, greedy=True, prompt_len=16)
    copy = sampler.weights.params
    specs, learner_specs = _specs(copy), _specs(params)
    assert learner_specs["layers/wq"] == P(None, "fsdp", "tensor", None)  # before the copy
    for path, spec in specs.items():
        assert "fsdp" not in str(spec), (path, spec)
    assert specs["layers/wq"] == P(None, None, "tensor", None)  # [layers, d, heads, e]
    assert specs["layers/wk"] == P(None, None, "tensor", None)  # kv heads
    assert specs["layers/wo"] == P(None, "tensor", None, None)
    assert specs["layers/w_up"] == P(None, None, "tensor")  # mlp
    assert specs["layers/w_down"] == P(None, "tensor", None)
    assert specs["embed"] == specs["lm_head"] == P("tensor", None)  # vocab
    engine = next(iter(sampler.engines.values()))
    ours = _collectives(sampler, copy, mesh)
    assert ours and all(spans <= {"tensor"} for _, spans in ours), ours
    # The same program on the learner's weights, cast but as they are sharded:
    as_is = jax.tree.map(lambda x: x.astype(BF16), params)
    theirs = _collectives(sampler, as_is, mesh)
    assert any("fsdp" in spans for _, spans in theirs), theirs
    assert engine.params is None


def test_decode_weights_are_checked():
    config = config_lib.defaults()
    config.sampling.decode_dtype = "bfloat16"
    with pytest.raises(ValueError, match="set sampling.engine=True"):
        config_lib.check(config)
    config.sampling.update(engine=True, decode_dtype="float16")
    with pytest.raises(ValueError, match="sampling.decode_dtype='float16'"):
        config_lib.check(config)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        decode_weights.DecodeWeights("float16")
