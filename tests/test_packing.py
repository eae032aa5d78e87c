"""ptrain.packing and packed SFT (`learner.sft` with sft.packing): the packed step's loss and
gradient against each document's own dense forward, no attention across documents, ring
attention over `sequence` against one shard, nothing dropped, resume, clear errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import grpo_toy
from ptrain import data as data_lib
from ptrain import learner as L
from ptrain import model as M
from ptrain import packing
from ptrain import sharding
from ptrain import step as step_lib
from ptrain.metrics import read_jsonl
from tests import hf_fixtures

pytestmark = pytest.mark.xdist_group("packing")

TINY = M.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                     attention_impl="ring", attn_block_q=8, attn_block_k=8)
SEQ = 32


def _docs(seed=0):
    """Documents (ids, weights): a prompt (weight 0) then a completion (weight 1, one token
    masked out as a tool observation would be)."""
    rng = np.random.RandomState(seed)
    out = []
    for p, c in [(3, 5), (2, 7), (4, 4), (5, 6), (2, 9)]:
        ids = rng.randint(1, TINY.vocab_size, p + c).tolist()
        weights = [0.0] * p + [1.0] * c
        weights[p + 1] = 0.0
        out.append((ids, weights))
    return out


def _mesh(**sizes):
    n = int(np.prod(list(sizes.values())))
    return sharding.make_mesh(**sizes, devices=jax.devices()[:n])


def test_packed_loss_and_gradient_equal_each_documents_own_dense_forward():
    docs = _docs()
    tokens_bt, seg_bt, weights_bt, n = packing.pack(docs, rows=2, seq_len=SEQ)
    assert n == len(docs) and seg_bt.max() > 1  # several documents share a row
    batch = packing.packed_batch(tokens_bt, seg_bt, weights_bt)

    # The reference: each document alone in its own row of a dense forward (no segment ids;
    # right-padded, which causal attention keeps out of the document), the token-mean NLL
    # of its weighted tokens over all documents.
    ref_model = M.init(TINY.replace(attention_impl="reference"), seed=3)
    ref_graphdef, params0 = nnx.split(ref_model)
    params0 = jax.device_get(params0)
    longest = max(len(ids) for ids, _ in docs)
    ids_dt = np.zeros((len(docs), longest), np.int32)
    weights_dt = np.zeros((len(docs), longest), np.float32)
    for i, (ids, weights) in enumerate(docs):
        ids_dt[i, :len(ids)], weights_dt[i, :len(ids)] = ids, weights

    def reference_loss(params):
        logp = jax.nn.log_softmax(nnx.merge(ref_graphdef, params)(jnp.asarray(ids_dt))[:, :-1])
        target = jnp.take_along_axis(logp, jnp.asarray(ids_dt[:, 1:])[..., None], -1)[..., 0]
        return -(target * weights_dt[:, 1:]).sum() / weights_dt[:, 1:].sum()

    loss, grads = jax.jit(jax.value_and_grad(reference_loss))(params0)

    # The packed step, through the program the learner runs; SGD with lr 1 makes the update
    # the gradient.
    mesh = _mesh(fsdp=2)
    graphdef, abstract = sharding.abstract(
        lambda: M.Transformer(TINY, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    params = jax.device_put(params0, jax.tree.map(lambda x: x.sharding, abstract))
    tx = optax.sgd(1.0)
    fn = step_lib.jit_packed_update(graphdef, tx, mesh, 8)
    new_params, _, metrics = jax.device_get(fn(params, tx.init(params),
                                               sharding.shard_batch(batch, mesh)))
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    packed_grads = jax.tree.map(lambda a, b: a - b, params0, new_params)
    for a, b in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
    # (jitted: one compile, not three small ones per parameter)
    np.testing.assert_allclose(metrics["grad_norm"], jax.jit(optax.global_norm)(grads),
                               rtol=1e-5)


def test_a_document_never_attends_across_its_segment_boundary():
    """Perturbing the first document of a row leaves the log-probs of the one after it
    unchanged (and changes its own)."""
    docs = _docs()[:2]
    model = M.init(TINY, seed=3, mesh=_mesh(fsdp=1))
    logp = nnx.jit(lambda m, b: jax.nn.log_softmax(
        m(b["tokens_bt"], b["positions_bt"], b["segment_ids_bt"])))

    def row_logp(docs):
        tokens_bt, seg_bt, weights_bt, _ = packing.pack(docs, rows=1, seq_len=SEQ)
        return np.asarray(logp(model, packing.packed_batch(tokens_bt, seg_bt, weights_bt)))

    first = len(docs[0][0])
    changed = [((np.asarray(docs[0][0]) + 1) % TINY.vocab_size).tolist(), docs[0][1]]
    base, perturbed = row_logp(docs), row_logp([changed, docs[1]])
    end = first + len(docs[1][0])
    np.testing.assert_allclose(perturbed[0, first:end], base[0, first:end], atol=1e-6)
    assert np.abs(perturbed[0, :first] - base[0, :first]).max() > 1e-3


def _prompts(records, batch_size):
    return data_lib.prompt_batches([(records, 1.0)], batch_size=batch_size, seed=0,
                                   shuffle=False, process_index=0, process_count=1)


def test_packer_drops_nothing_and_resumes_where_it_stopped():
    records = [{"ids": list(range(1, 2 + i % 7)), "i": i} for i in range(40)]
    document = lambda r: (r["ids"], [1.0] * len(r["ids"]))  # noqa: E731
    packer = packing.Packer(_prompts(records, 3), document, rows=2, seq_len=8)
    seen, states = [], []
    for _ in range(6):
        states.append(packer.get_state())
        tokens_bt, seg_bt, _, n = packer.next_rows()
        docs = [tokens_bt[r][seg_bt[r] == s].tolist() for r in range(2)
                for s in range(1, seg_bt[r].max() + 1)]
        assert len(docs) == n > 0
        seen.append(docs)
    # In order, none skipped, none twice (the stream repeats after 40 records).
    assert [d for step in seen for d in step] == [r["ids"] for r in records][:sum(map(len, seen))]
    resumed = packing.Packer(_prompts(records, 3), document, rows=2, seq_len=8,
                             state=states[3])
    for want in seen[3:]:
        tokens_bt, seg_bt, _, _ = resumed.next_rows()
        assert [tokens_bt[r][seg_bt[r] == s].tolist() for r in range(2)
                for s in range(1, seg_bt[r].max() + 1)] == want


def test_a_record_longer_than_seq_len_is_an_error_unless_truncated():
    records = [{"ids": list(range(1, 12))}] * 4
    document = lambda r: (r["ids"], [1.0] * len(r["ids"]))  # noqa: E731
    with pytest.raises(ValueError, match=r"record of 11 tokens .* longer than sft.seq_len=8.*"
                                         r"sft.truncate=True"):
        packing.Packer(_prompts(records, 2), document, rows=2, seq_len=8).next_rows()
    tokens_bt, seg_bt, _, n = packing.Packer(_prompts(records, 2), document, rows=2, seq_len=8,
                                             truncate=True).next_rows()
    assert n == 2 and (tokens_bt == np.arange(1, 9)).all() and (seg_bt == 1).all()


# ------------------------------------------------------------------------- packed SFT runs


def _sft_config(**changes):
    rng = np.random.RandomState(1)
    records = [{"prompt_ids": rng.randint(1, 32, rng.randint(2, 6)).tolist(),
                "completion_ids": rng.randint(1, 32, rng.randint(2, 9)).tolist()}
               for _ in range(64)]
    c = grpo_toy.get_config()
    c.model.update(attention_impl="ring", attn_block_q=8, attn_block_k=8)
    c.sft.update(steps=2, batch_size=2, packing=True, seq_len=SEQ, records_fn=lambda s: records)
    c.sft.optim.update(lr=1e-2, schedule="constant")
    c.update_from_flattened_dict(changes)
    return c


@pytest.fixture(scope="module")
def sft_params():
    return jax.device_get(nnx.state(L.build_model(_sft_config(), _mesh(fsdp=1))))


def _losses(workdir):
    return [r["sft/loss"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def test_packed_sft_with_ring_attention_over_sequence_equals_one_shard(sft_params, tmp_path,
                                                                      monkeypatch):
    calls = []
    real = step_lib.jit_packed_update
    monkeypatch.setattr(step_lib, "jit_packed_update", lambda *a: calls.append(a) or real(*a))
    one = L.sft(_sft_config(), str(tmp_path / "one"), params=sft_params, mesh=_mesh(fsdp=2))
    ring = L.sft(_sft_config(**{"sft.layout": "zigzag"}), str(tmp_path / "ring"),
                 params=sft_params, mesh=_mesh(fsdp=2, sequence=2))
    assert len(calls) == 4  # each step through step.jit_packed_update (plan.compile_plan's)
    np.testing.assert_allclose(_losses(tmp_path / "ring"), _losses(tmp_path / "one"), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(ring)), jax.tree.leaves(jax.device_get(one))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    metrics = read_jsonl(os.path.join(tmp_path / "one", "metrics.jsonl"))
    assert all(r["sft/documents"] > 2 for r in metrics)  # rows hold several records


def test_packed_sft_resumes_as_the_uninterrupted_run(sft_params, tmp_path):
    mesh = _mesh(fsdp=2)  # the mesh and shapes of the test above: its programs, compiled once
    full = L.sft(_sft_config(**{"sft.steps": 4}), str(tmp_path / "full"), params=sft_params,
                 mesh=mesh)
    L.sft(_sft_config(), str(tmp_path / "cut"), params=sft_params, mesh=mesh)
    resumed = L.sft(_sft_config(**{"sft.steps": 4}), str(tmp_path / "cut"),
                    params=sft_params, mesh=mesh)
    assert _losses(tmp_path / "cut")[2:] == _losses(tmp_path / "full")[2:]
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed)),
                    jax.tree.leaves(jax.device_get(full))):
        np.testing.assert_array_equal(a, b)


def test_packed_sft_config_errors():
    with pytest.raises(ValueError, match="sft.layout='zigzag' balances ring attention"):
        L.check_config(_sft_config(**{"sft.layout": "zigzag", "model.attention_impl":
                                      "blockwise"}))
    config = _sft_config(**{"sft.seq_len": 31})
    with pytest.raises(ValueError, match=r"sft.seq_len=31 must divide into 2 chunks"):
        L.Learner(config, mesh=_mesh(fsdp=2, sequence=2))


# ------------------------------------------------------------ MoE: the router's losses, packed

def _hf_moe(path, **changes):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return hf_fixtures.tiny_qwen3_moe(path, **changes)


def test_packed_moe_step_adds_transformers_router_losses_over_the_documents(tmp_path):
    """A MoE's packed step (documents back to back, rows padded at their ends): its NLL, aux
    and z losses are transformers' over the same documents one per row, right-padded, under
    the attention mask (padding counts for neither: `Qwen3MoeForCausalLM`'s own aux_loss,
    `load_balancing_loss_func`; z = the mean of logsumexp(router logits)^2 over the
    documents' tokens and the MoE layers), and its gradient is torch's of
    NLL + aux_coef x aux + z_coef x z, on a fsdp=2 x expert=2 mesh (experts sharded, tokens
    dispatched by all-to-all)."""
    import torch
    from ptrain import hf
    aux_coef, z_coef = 0.01, 0.001
    ref = _hf_moe(str(tmp_path / "hf"), router_aux_loss_coef=aux_coef)
    docs = [(ids, w) for ids, w in _docs(1)]
    tokens_bt, seg_bt, weights_bt, n = packing.pack(docs, rows=2, seq_len=SEQ)
    assert n == len(docs) and seg_bt.max() > 1 and (seg_bt == 0).any()  # shared rows, padding
    batch = packing.packed_batch(tokens_bt, seg_bt, weights_bt)

    # transformers: each document alone in a right-padded row, labels where the weight is 1.
    longest = max(len(ids) for ids, _ in docs)
    ids_dt = torch.zeros((len(docs), longest), dtype=torch.long)
    mask_dt = torch.zeros((len(docs), longest), dtype=torch.long)
    labels_dt = torch.full((len(docs), longest), -100, dtype=torch.long)
    for i, (ids, weights) in enumerate(docs):
        ids_dt[i, :len(ids)], mask_dt[i, :len(ids)] = torch.tensor(ids), 1
        labels_dt[i, :len(ids)] = torch.tensor([t if w else -100 for t, w in zip(ids, weights)])
    out = ref(ids_dt, attention_mask=mask_dt, labels=labels_dt, output_router_logits=True)
    valid = mask_dt.reshape(-1).bool()
    lse = torch.cat([torch.logsumexp(r.float(), -1)[valid] for r in out.router_logits])
    z = torch.mean(lse ** 2)
    aux = out.aux_loss
    nll = out.loss - aux_coef * aux
    ref.zero_grad()
    (out.loss + z_coef * z).backward()
    with torch.no_grad():  # the gradient as a checkpoint: read into our layout by hf.load
        for p in ref.parameters():
            p.copy_(p.grad)
    ref.save_pretrained(str(tmp_path / "grad"))
    nll, aux, z, total = (float(v.detach()) for v in (nll, aux, z, out.loss + z_coef * z))

    # Ours: the learner's packed program; SGD with lr 1 makes the update the gradient.
    mesh = _mesh(fsdp=2, expert=2)
    overrides = {"attention_impl": "ring", "attn_block_q": 8, "attn_block_k": 8,
                 "router_aux_loss_coef": aux_coef, "router_z_loss_coef": z_coef}
    model, _ = hf.load(str(tmp_path / "hf"), mesh=mesh, overrides=overrides)
    graphdef, params = nnx.split(model)
    params0 = jax.device_get(params)
    tx = optax.sgd(1.0)
    fn = step_lib.jit_packed_update(graphdef, tx, mesh, 8)
    new_params, _, metrics = jax.device_get(fn(params, tx.init(params),
                                               sharding.shard_batch(batch, mesh)))
    np.testing.assert_allclose(metrics["loss"], nll, rtol=1e-5)
    np.testing.assert_allclose(metrics["moe/aux_loss"], aux, rtol=2e-5)
    np.testing.assert_allclose(metrics["moe/z_loss"], z, rtol=2e-5)
    np.testing.assert_allclose(metrics["optim/loss"], total, rtol=1e-5)
    assert abs(metrics["moe/load"].sum() - 1) < 1e-6 and metrics["moe/dropped_fraction"] == 0
    want = jax.device_get(nnx.state(hf.load(str(tmp_path / "grad"))[0]))
    grads = jax.tree.map(lambda a, b: a - b, params0, new_params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_packed_sft_on_a_moe_logs_the_router_losses(tmp_path):
    """sft.packing with the router's coefficients > 0 (refused before): each step's log has
    the aux and z losses and the per-expert load."""
    c = _sft_config(**{"model.n_experts": 8, "model.n_experts_per_token": 2,
                       "model.d_ff_expert": 16, "model.dense_layers": (0,),
                       "model.router_aux_loss_coef": 0.01, "model.router_z_loss_coef": 0.001})
    L.sft(c, str(tmp_path), mesh=_mesh(fsdp=1))
    records = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["moe/aux_loss"] > 0 and r["moe/z_loss"] > 0 and r["moe/dropped_fraction"] == 0
        assert len(r["moe/load"]) == 8 and abs(sum(r["moe/load"]) - 1) < 1e-5
