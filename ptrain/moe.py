"""Mixture-of-experts MLP: Qwen3-MoE routing, dropless dispatch, expert parallelism.

Routing is transformers' `Qwen3MoeTopKRouter`: router logits in the compute dtype, softmax
over all experts in float32, top-k, renormalised over the k when `norm_topk_prob`. A layer is
sparse when `(i + 1) % moe_layer_step == 0` and i is not in `dense_layers` (HF's
`decoder_sparse_step` / `mlp_only_layers`); DeepSeek-style shared experts (one always-on MLP
of `n_shared_experts * d_ff_expert`) are added where configured.

Dispatch (`ModelConfig.moe_dispatch`):
  dropless  assignments sorted by expert, grouped matmuls (`jax.lax.ragged_dot`); every token
            reaches its k experts whatever the imbalance.
  capacity  each expert takes at most C = ceil(capacity_factor * n * k / E) of a token
            shard's assignments (in token order; the rest are dropped and counted), into a
            fixed [E, C] buffer and batched matmuls.
  dense     every token through every expert, weighted by its (mostly zero) combine weights:
            the reference the others must equal, E / k times the FLOPs.

Expert parallelism: expert weights are sharded over the mesh's `expert` axis (the logical
axis "experts", see `sharding.RULES`). Inside `shard_map` each device routes its own tokens,
sends each assignment to the device that holds its expert with one `all_to_all`, runs its
local experts and sends the results back with a second. Dropless needs a worst-case buffer
(n * k rows per destination); capacity sends [E_local, C] per destination. Tokens are sharded
over data x fsdp x expert (batch) and sequence (time); where the token block is replicated
over `expert` (a batch that does not divide) each expert device takes a slice of it and the
results are gathered back. A tensor-sharded expert hidden dim is summed with one psum.

Padding tokens (segment id 0) are not dispatched (their MoE output is 0) and not counted.
Per-layer statistics come back as a `Routing` record: the chosen experts (what router replay
feeds back), the load per expert, the router-probability mass per expert (for the load-
balancing loss), the router z-loss and the dropped assignments.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ptrain import lora
from ptrain import projection
from ptrain import sharding

DISPATCHES = ("dropless", "capacity", "dense")
ROUTER_LOSS_SCOPES = ("microbatch", "global")  # ModelConfig.router_loss_scope


# ----------------------------------------------------------------------------- layout

def is_moe_layer(c, i: int) -> bool:
    return c.n_experts > 0 and i not in c.dense_layers and (i + 1) % c.moe_layer_step == 0


def n_moe_layers(c) -> int:
    return sum(is_moe_layer(c, i) for i in range(c.n_layers))


def stages(c) -> list[tuple[bool, int, int, int]]:
    """Runs of consecutive layers of one kind: (is_moe, start, stop, offset), where offset
    is the run's first index into the dense (or MoE) MLP stack."""
    out, counts = [], {False: 0, True: 0}
    for i in range(c.n_layers):
        kind = is_moe_layer(c, i)
        if out and out[-1][0] == kind:
            out[-1][2] = i + 1
        else:
            out.append([kind, i, i + 1, counts[kind]])
        counts[kind] += 1
    return [tuple(s) for s in out]


def d_ff_shared(c) -> int:
    return c.n_shared_experts * c.d_ff_expert


def check_config(c) -> list[tuple[bool, str]]:
    """ModelConfig checks for the MoE fields (ok, message) pairs."""
    if c.n_experts == 0:
        return [(c.n_shared_experts == 0, "n_shared_experts needs n_experts > 0")]
    return [
        (1 <= c.n_experts_per_token <= c.n_experts,
         f"n_experts_per_token ({c.n_experts_per_token}) must be in 1..n_experts "
         f"({c.n_experts})"),
        (c.d_ff_expert > 0, "d_ff_expert (moe_intermediate_size) must be > 0"),
        (c.moe_layer_step >= 1, f"moe_layer_step must be >= 1, got {c.moe_layer_step}"),
        (all(0 <= i < c.n_layers for i in c.dense_layers),
         f"dense_layers {c.dense_layers} must be layer indices below {c.n_layers}"),
        (c.moe_dispatch in DISPATCHES,
         f"moe_dispatch {c.moe_dispatch!r} is not one of {DISPATCHES}"),
        (c.moe_capacity_factor > 0, "moe_capacity_factor must be > 0"),
        (c.router_loss_scope in ROUTER_LOSS_SCOPES,
         f"router_loss_scope {c.router_loss_scope!r} is not one of {ROUTER_LOSS_SCOPES}"),
    ]


def n_params(c) -> tuple[int, int]:
    """(total, active per token) parameters of the MoE layers' MLPs (router included)."""
    d, e, fe = c.d_model, c.n_experts, c.d_ff_expert
    shared = 3 * d * d_ff_shared(c)
    per_layer = d * e + e * 3 * d * fe + shared
    active = d * e + c.n_experts_per_token * 3 * d * fe + shared
    n = n_moe_layers(c)
    return n * per_layer, n * active


# ----------------------------------------------------------------------------- parameters

class Experts(nnx.Module):
    """The MoE layers' router and expert weights, stacked on a leading MoE-layer axis."""

    def __init__(self, c, rngs: nnx.Rngs, param):
        l, d, e, f = n_moe_layers(c), c.d_model, c.n_experts, c.d_ff_expert
        dt = jnp.dtype(c.param_dtype)
        self.router = param(rngs, (l, d, e), ("layers", "embed", None), dt)
        self.w_gate = param(rngs, (l, e, d, f), ("layers", "experts", "embed", "mlp"), dt)
        self.w_up = param(rngs, (l, e, d, f), ("layers", "experts", "embed", "mlp"), dt)
        self.w_down = param(rngs, (l, e, f, d), ("layers", "experts", "mlp", "embed"), dt)
        fs = d_ff_shared(c)
        if fs:
            self.shared_gate = param(rngs, (l, d, fs), ("layers", "embed", "mlp"), dt)
            self.shared_up = param(rngs, (l, d, fs), ("layers", "embed", "mlp"), dt)
            self.shared_down = param(rngs, (l, fs, d), ("layers", "mlp", "embed"), dt)

    def arrays(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


# ----------------------------------------------------------------------------- routing record

@flax.struct.dataclass
class Routing:
    """What the MoE layers did, stacked over MoE layers (l = MoE layers only).

    experts_lbtk: the k experts each token was sent to (int32), in top-k order.
    load_le: valid assignments per expert; prob_le: router probability summed per expert;
    z_l: sum over tokens of logsumexp(router logits)^2; dropped_l: assignments dropped
    (0 when dropless); tokens_l: valid tokens; agree_l: valid assignments whose expert is
    among the router's own top-k (all of them unless the experts were replayed; none of a
    token replayed as unrecorded, -1).
    """

    experts_lbtk: jax.Array
    load_le: jax.Array
    prob_le: jax.Array
    z_l: jax.Array
    dropped_l: jax.Array
    tokens_l: jax.Array
    agree_l: jax.Array


def routing_from_stats(stats: dict) -> Routing:
    """A Routing from `block`'s statistics stacked over layers."""
    return Routing(experts_lbtk=stats["experts_btk"], load_le=stats["load_e"],
                   prob_le=stats["prob_e"], z_l=stats["z"], dropped_l=stats["dropped"],
                   tokens_l=stats["tokens"], agree_l=stats["agree"])


def concat(parts: list[Routing]) -> Routing | None:
    if not parts:
        return None
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)


def add(a: Routing | None, b: Routing | None) -> Routing | None:
    """The statistics of two forwards of the same layers pooled (a prompt's and its
    continuations'); the experts are `b`'s."""
    if a is None or b is None:
        return a if b is None else b
    return jax.tree.map(jnp.add, a.replace(experts_lbtk=b.experts_lbtk), b)


def agreement_l(r: Routing, recorded_lbtk, valid_bt, *, replayed: bool) -> jax.Array:
    """Per MoE layer, the share of the recorded assignments (a sampler's `experts_lbtk`)
    that this forward's router chose too, over valid tokens with recorded experts (not -1):
    with `replayed` the forward used the recorded experts and `agree_l` counts those in its
    router's own top-k; else its own experts are compared with the recorded ones as sets.
    `r` must be the forward over exactly these tokens."""
    valid_bt = (valid_bt.astype(bool) & (recorded_lbtk[0, ..., 0] >= 0)).astype(jnp.float32)
    k = recorded_lbtk.shape[-1]
    if replayed:
        agree_l = r.agree_l
    else:
        hit_lbtk = jnp.any(recorded_lbtk[..., :, None] == r.experts_lbtk[..., None, :], -1)
        agree_l = jnp.einsum("lbtk,bt->l", hit_lbtk.astype(jnp.float32), valid_bt)
    return agree_l / jnp.maximum(k * jnp.sum(valid_bt), 1.0)


def aux_loss(r: Routing) -> jax.Array:
    """Switch-Transformer load balancing as transformers' `load_balancing_loss_func`: per
    expert, the fraction of assignments times the mean router probability, both pooled over
    layers and tokens, summed and scaled by the number of experts."""
    rows = jnp.maximum(jnp.sum(r.tokens_l), 1.0)
    fraction_e = jnp.sum(r.load_le, axis=0) / rows
    prob_e = jnp.sum(r.prob_le, axis=0) / rows
    return r.load_le.shape[-1] * jnp.sum(fraction_e * prob_e)


def z_loss(r: Routing) -> jax.Array:
    """ST-MoE router z-loss: mean over tokens and layers of logsumexp(logits)^2."""
    return jnp.sum(r.z_l) / jnp.maximum(jnp.sum(r.tokens_l), 1.0)


def router_loss(r: Routing | None, c) -> jax.Array:
    """What the training loss adds: aux and z losses weighted by the config's coefficients."""
    if r is None:
        return jnp.zeros((), jnp.float32)
    return c.router_aux_loss_coef * aux_loss(r) + c.router_z_loss_coef * z_loss(r)


def global_terms(r: Routing, load_le, tokens_l) -> tuple[jax.Array, jax.Array]:
    """This forward's terms of the aux and z losses of a larger batch it is part of (an
    optimizer step's microbatches), given that batch's assignments per expert `load_le` and
    valid tokens `tokens_l` (constants): the terms of the batch's forwards add up to
    `aux_loss` and `z_loss` of the whole batch (Megatron's global_aux_loss, exact here). The
    aux loss is linear in the router probabilities once the loads are fixed, so its gradient
    splits over the forwards the same way."""
    rows = jnp.maximum(jnp.sum(tokens_l), 1.0)
    fraction_e = jnp.sum(load_le, axis=0) / rows
    aux = load_le.shape[-1] * jnp.sum(fraction_e * jnp.sum(r.prob_le, axis=0) / rows)
    return aux, jnp.sum(r.z_l) / rows


def metrics(r: Routing) -> dict[str, jax.Array]:
    """Scalars (and the per-expert load vector `moe/load`, a histogram) for the run log."""
    load_e = jnp.sum(r.load_le, axis=0)
    share_e = load_e / jnp.maximum(jnp.sum(load_e), 1.0)
    assignments = jnp.maximum(jnp.sum(r.load_le) + jnp.sum(r.dropped_l), 1.0)
    return {
        "moe/aux_loss": aux_loss(r),
        "moe/z_loss": z_loss(r),
        "moe/dropped_fraction": jnp.sum(r.dropped_l) / assignments,
        "moe/load_max_over_mean": jnp.max(share_e) * share_e.shape[0],
        "moe/load": share_e,
    }


# ----------------------------------------------------------------------------- the block

def route(h_nd, router_de, c, replay_nk=None):
    """(logits [n, E] compute dtype, probs [n, E] f32, top weights [n, k] f32, top ids
    [n, k], which of the ids are among the router's own top-k [n, k] bool). With `replay_nk`,
    those experts are used instead of the top-k (their probabilities are still the router's,
    so the router gets gradients as usual); a token whose replayed experts are -1
    (`ptrain.routing.UNRECORDED`) takes the top-k and counts as not agreeing."""
    logits_ne = jnp.einsum("nd,de->ne", h_nd, router_de.astype(h_nd.dtype))
    probs_ne = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs_ne, c.n_experts_per_token)
    own_nk = jnp.ones(top_i.shape, bool)
    if replay_nk is not None:
        own_i = top_i
        recorded_n1 = replay_nk[:, :1] >= 0  # unrecorded (-1): the router's own top-k
        top_i = jnp.where(recorded_n1, replay_nk.astype(jnp.int32), own_i)
        top_w = jnp.take_along_axis(probs_ne, top_i, axis=-1)
        own_nk = jnp.any(top_i[:, :, None] == own_i[:, None, :], axis=-1) & recorded_n1
    if c.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return logits_ne, probs_ne, top_w, top_i, own_nk


def block(p: dict, h_btd, valid_bt, c, mesh, replay_btk=None):
    """The MoE MLP of one layer: (output [b, t, d], this layer's routing statistics)."""
    if mesh is None or c.moe_dispatch == "dense":
        y_btd, stats = _local(p, h_btd, valid_bt, replay_btk, c, axes=None)
    else:
        y_btd, stats = _sharded(p, h_btd, valid_bt, replay_btk, c, mesh)
    if "shared_gate" in p:
        y_btd = y_btd + _mlp(h_btd, p["shared_gate"], p["shared_up"], p["shared_down"], mesh)
    return y_btd, stats


def _mlp(h_btd, w_gate, w_up, w_down, mesh):
    gate_btf = projection.dense(h_btd, w_gate, mesh=mesh)
    up_btf = projection.dense(h_btd, w_up, mesh=mesh)
    act_btf = sharding.constrain(jax.nn.silu(gate_btf) * up_btf, ("batch", "seq", "mlp"), mesh)
    return projection.dense(act_btf, w_down, mesh=mesh)


def _sharded(p, h_btd, valid_bt, replay_btk, c, mesh):
    tok = sharding.spec(("batch", "seq", None), h_btd.shape, mesh)
    w_spec = sharding.spec(("experts", None, "mlp"), p["w_gate"].shape, mesh)
    ep = mesh.shape["expert"] if w_spec[0] is not None else 1
    token_axes = tuple(a for entry in tok for a in (
        (entry,) if isinstance(entry, str) else (entry or ())))
    split = ep > 1 and "expert" not in token_axes  # tokens replicated over expert: split them
    axes = dict(tensor="tensor" if w_spec[2] else None, split=split, ep=ep,
                stats=token_axes + (("expert",) if split else ()))
    down_spec = P(w_spec[0], w_spec[2], None)
    weights = {"router": P(None, None), "w_gate": w_spec, "w_up": w_spec, "w_down": down_spec}
    if "w_gate_lora_a" in p or "w_down_lora_a" in p:  # per-expert adapters (`lora`), as W's
        e_ax, f_ax = w_spec[0], w_spec[2]
        adapters = {"w_gate": (P(e_ax, None, None), P(e_ax, None, f_ax)),
                    "w_up": (P(e_ax, None, None), P(e_ax, None, f_ax)),
                    "w_down": (P(e_ax, f_ax, None), P(e_ax, None, None))}
        weights.update({f"{n}_lora_{ab}": spec for n, specs in adapters.items()
                        if f"{n}_lora_a" in p for ab, spec in zip("ab", specs)})
    inputs = {k: p[k] for k in weights}
    specs = [weights, tok, P(*tok[:2])]
    args = [inputs, h_btd, valid_bt]
    if replay_btk is not None:
        specs.append(tok)
        args.append(replay_btk)
    stat_specs = {"experts_btk": tok, "load_e": P(), "prob_e": P(), "z": P(), "dropped": P(),
                  "tokens": P(), "agree": P()}

    def local(w, h, valid, replay=None):
        return _local(w, h, valid, replay, c, axes=axes)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                         out_specs=(tok, stat_specs))(*args)


def _local(p, h_btd, valid_bt, replay_btk, c, *, axes):
    """One token shard's MoE MLP. `axes` None: the whole (unsharded) computation; else the
    mesh axes inside shard_map (ep: the size of the `expert` all-to-all axis, tensor: the
    axis to psum the hidden dim's shards over, stats: the axes to sum statistics over,
    split: take a slice of a block replicated over expert)."""
    b, t, d = h_btd.shape
    k, dt = c.n_experts_per_token, h_btd.dtype
    h_nd, valid_n = h_btd.reshape(b * t, d), valid_bt.reshape(b * t) != 0
    replay_nk = None if replay_btk is None else replay_btk.reshape(b * t, k)
    n_all = b * t
    if axes is not None and axes["split"]:  # each expert device takes 1/ep of the tokens
        ep = axes["ep"]
        pad = -n_all % ep
        piece = (n_all + pad) // ep
        start = jax.lax.axis_index("expert") * piece

        def take(x):
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
            return jax.lax.dynamic_slice_in_dim(x, start, piece)

        h_nd, valid_n = take(h_nd), take(valid_n)
        replay_nk = None if replay_nk is None else take(replay_nk)

    logits_ne, probs_ne, top_w, top_i, own_nk = route(h_nd, p["router"], c, replay_nk)
    w = {name: lora.expert_weight(p, name, c).astype(dt)  # (with per-expert LoRA: merged)
         for name in ("w_gate", "w_up", "w_down")}
    if c.moe_dispatch == "dense":
        rows_nkd, kept_nk = _dense(h_nd, top_i, w), jnp.ones(top_i.shape, bool)
    else:
        dispatch = _dropless if c.moe_dispatch == "dropless" else _capacity
        rows_nkd, kept_nk = dispatch(h_nd, top_i, valid_n, w, c, axes)
    combine_nk = jnp.where(kept_nk & valid_n[:, None], top_w, 0).astype(dt)
    y_nd = jnp.einsum("nkd,nk->nd", rows_nkd, combine_nk)

    # Statistics; the router probabilities and logits keep their gradients (aux, z losses).
    valid = valid_n.astype(jnp.float32)
    onehot_nke = jax.nn.one_hot(jax.lax.stop_gradient(top_i), c.n_experts, dtype=jnp.float32)
    lse_n = jax.nn.logsumexp(logits_ne.astype(jnp.float32), axis=-1)
    stats = {
        "load_e": jnp.einsum("nke,n->e", onehot_nke * kept_nk[..., None], valid),
        "prob_e": jnp.einsum("ne,n->e", probs_ne, valid),
        "z": jnp.sum(jnp.square(lse_n) * valid),
        "dropped": jnp.sum((~kept_nk) * valid[:, None]).astype(jnp.float32),
        "tokens": jnp.sum(valid),
        "agree": jnp.einsum("nk,n->", own_nk.astype(jnp.float32), valid),
    }
    experts_nk = top_i
    if axes is not None and axes["stats"]:
        stats = jax.tree.map(lambda x: jax.lax.psum(x, axes["stats"]), stats)
    if axes is not None and axes["split"]:  # back to the whole block (psum: replicated)
        def gather(x):
            whole = jnp.zeros((piece * axes["ep"],) + x.shape[1:], x.dtype)
            whole = jax.lax.dynamic_update_slice_in_dim(whole, x, start, 0)
            return jax.lax.psum(whole, "expert")[:n_all]

        y_nd, experts_nk = gather(y_nd), gather(experts_nk)
    stats["experts_btk"] = experts_nk.reshape(b, t, k)
    return y_nd.reshape(b, t, d), stats


def _expert_mlp_grouped(x_md, group_sizes, w, tensor_axis):
    """SwiGLU of rows sorted by expert: grouped matmuls over `group_sizes` (rows past their
    sum come back zero)."""
    gate = jax.lax.ragged_dot(x_md, w["w_gate"], group_sizes)
    up = jax.lax.ragged_dot(x_md, w["w_up"], group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w["w_down"], group_sizes)
    return out if tensor_axis is None else jax.lax.psum(out, tensor_axis)


def _expert_mlp_batched(x_ecd, w, tensor_axis):
    gate = jnp.einsum("ecd,edf->ecf", x_ecd, w["w_gate"])
    up = jnp.einsum("ecd,edf->ecf", x_ecd, w["w_up"])
    out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w["w_down"])
    return out if tensor_axis is None else jax.lax.psum(out, tensor_axis)


def _sort_by(ids_m, n_groups: int):
    """Stable order of `ids_m` (values in [0, n_groups], n_groups = none), the sorted ids,
    each sorted row's rank within its group, and the group sizes (none excluded)."""
    order = jnp.argsort(ids_m, stable=True)
    sorted_ids = ids_m[order]
    sizes = jnp.bincount(ids_m, length=n_groups + 1)[:n_groups]
    starts = jnp.concatenate([jnp.zeros((1,), sizes.dtype), jnp.cumsum(sizes)])
    rank = jnp.arange(ids_m.shape[0]) - starts[jnp.minimum(sorted_ids, n_groups)]
    return order, sorted_ids, rank, sizes


def _dropless(h_nd, top_i, valid_n, w, c, axes):
    """Rows [n, k, d] (each assignment's expert output, unweighted), all kept."""
    n, k = top_i.shape
    e = c.n_experts
    ids = jnp.where(valid_n[:, None], top_i, e).reshape(-1)
    ep = 1 if axes is None else axes["ep"]
    tensor_axis = None if axes is None else axes["tensor"]
    e_local = e // ep
    order, sorted_ids, _, _ = _sort_by(ids, e)
    x_md = h_nd[order // k]
    if ep == 1:
        sizes = jnp.bincount(ids, length=e + 1)[:e]
        out_md = _expert_mlp_grouped(x_md, sizes, w, tensor_axis)
    else:
        # Per destination device, up to every local assignment (n * k rows): never drops.
        dest = sorted_ids // e_local  # ep for none
        _, _, rank, _ = _sort_by(dest, ep)  # dest is already sorted: order is the identity
        cap = n * k
        slot = jnp.where(dest < ep, dest * cap + rank, ep * cap)
        send_x = jnp.zeros((ep * cap + 1, x_md.shape[1]), x_md.dtype).at[slot].set(x_md)
        send_e = jnp.full((ep * cap + 1,), e_local, jnp.int32).at[slot].set(
            sorted_ids % e_local)
        recv_x = jax.lax.all_to_all(send_x[:-1].reshape(ep, cap, -1), "expert", 0, 0)
        recv_e = jax.lax.all_to_all(send_e[:-1].reshape(ep, cap), "expert", 0, 0)
        recv_x, recv_e = recv_x.reshape(ep * cap, -1), recv_e.reshape(-1)
        r_order, _, _, r_sizes = _sort_by(recv_e, e_local)
        r_out = _expert_mlp_grouped(recv_x[r_order], r_sizes, w, tensor_axis)
        r_out = jnp.zeros_like(r_out).at[r_order].set(r_out)
        back = jax.lax.all_to_all(r_out.reshape(ep, cap, -1), "expert", 0, 0)
        back = jnp.concatenate([back.reshape(ep * cap, -1), jnp.zeros_like(back[0, :1])])
        out_md = back[slot]
    rows = jnp.zeros_like(out_md).at[order].set(out_md)
    return rows.reshape(n, k, -1), jnp.ones((n, k), bool)


def capacity(n_tokens: int, c) -> int:
    """Assignments one expert takes from a shard of `n_tokens` tokens (capacity dispatch)."""
    return max(1, math.ceil(c.moe_capacity_factor * n_tokens * c.n_experts_per_token
                            / c.n_experts))


def _capacity(h_nd, top_i, valid_n, w, c, axes):
    """Rows [n, k, d] and which assignments were kept (per-expert capacity, token order)."""
    n, k = top_i.shape
    e = c.n_experts
    ep = 1 if axes is None else axes["ep"]
    tensor_axis = None if axes is None else axes["tensor"]
    e_local, cap = e // ep, capacity(n, c)
    ids = jnp.where(valid_n[:, None], top_i, e).reshape(-1)
    order, sorted_ids, rank, _ = _sort_by(ids, e)
    keep = (sorted_ids < e) & (rank < cap)
    slot = jnp.where(keep, sorted_ids * cap + rank, e * cap)  # [dest, local expert, C] layout
    d = h_nd.shape[1]
    buf = jnp.zeros((e * cap + 1, d), h_nd.dtype).at[slot].set(h_nd[order // k])[:-1]
    if ep == 1:
        out = _expert_mlp_batched(buf.reshape(e, cap, d), w, tensor_axis)
    else:
        recv = jax.lax.all_to_all(buf.reshape(ep, e_local, cap, d), "expert", 0, 0)
        x_ecd = recv.transpose(1, 0, 2, 3).reshape(e_local, ep * cap, d)
        out = _expert_mlp_batched(x_ecd, w, tensor_axis)
        out = out.reshape(e_local, ep, cap, d).transpose(1, 0, 2, 3)
        out = jax.lax.all_to_all(out, "expert", 0, 0)
    out = jnp.concatenate([out.reshape(e * cap, d), jnp.zeros((1, d), out.dtype)])
    rows = jnp.zeros((n * k, d), out.dtype).at[order].set(out[slot])
    kept = jnp.zeros((n * k,), bool).at[order].set(keep)
    return rows.reshape(n, k, d), kept.reshape(n, k) | ~valid_n[:, None]


def _dense(h_nd, top_i, w):
    """Every token through every expert; rows [n, k, d] picked from the [n, E, d] outputs."""
    gate = jnp.einsum("nd,edf->nef", h_nd, w["w_gate"])
    up = jnp.einsum("nd,edf->nef", h_nd, w["w_up"])
    out_ned = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, w["w_down"])
    return jnp.take_along_axis(out_ned, top_i[:, :, None], axis=1)
