"""A group's prompt, run once: the prefill that the sampler and the learner share.

`prefill_shared` runs each (left-padded) prompt once and repeats its KV cache for the G rows
of its group; the sampler continues the copies with samples (`ptrain.generate.sampler`), the learner's
programs with the samples' tokens, differentiating through the repeat (`ptrain.step`). So a
long prompt costs one forward (and in training one backward) per group, not G.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptrain import model as model_lib


def left_padded(lengths_b, t):
    """Segment ids (1 on tokens, 0 on the left padding) and RoPE positions of prompts
    right-aligned in `t` columns."""
    segment_ids_bt = (jnp.arange(t)[None, :] >= t - lengths_b[:, None]).astype(jnp.int32)
    return segment_ids_bt, jnp.maximum(jnp.cumsum(segment_ids_bt, axis=1) - 1, 0)


def prefill_shared(model, prompt_bt, lengths_b, *, repeats, extra_slots, replay_lbtk=None,
                   **forward_kw):
    """Runs each prompt once and returns (final hidden state of each prompt [b, d], the cache
    repeated `repeats` times with `extra_slots` empty slots appended, the prompts' MoE
    `Routing` or None): row i's copies are rows i*repeats .. i*repeats+repeats-1. The sampler
    continues the copies with samples; the learner with the samples' tokens, differentiating
    through the repeat. `replay_lbtk`: experts to route the prompt tokens to (`model.forward`);
    `forward_kw`: the rest of `model.forward`'s options (a VL prompt's merged embeddings and
    M-RoPE positions)."""
    b, t = prompt_bt.shape
    segment_ids_bt, positions_bt = left_padded(lengths_b, t)
    cache = model_lib.init_cache(model.config, b, t)
    h_btd, cache, routing = model.forward(prompt_bt, positions_bt, segment_ids_bt, cache,
                                          replay_lbtk=replay_lbtk, **forward_kw)

    def grow(x, axis):  # repeat rows, then append empty slots
        x = jnp.repeat(x, repeats, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis + 1] = (0, extra_slots)
        return jnp.pad(x, pad)

    cache = model_lib.KVCache(grow(cache.k_lbske, 1), grow(cache.v_lbske, 1),
                              grow(cache.positions_bs, 0), grow(cache.segment_ids_bs, 0),
                              cache.index)
    if model.mesh is not None:
        cache = jax.tree.map(jax.lax.with_sharding_constraint, cache,
                             model_lib.cache_shardings(cache, model.mesh))
    return h_btd[:, -1], cache, routing
