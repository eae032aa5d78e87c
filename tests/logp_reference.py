"""The learner's side of a log-prob comparison: log softmax(logits / T) of sampled ids after a
prompt, from one dense teacher-forced forward (what an engine's reported log-probs must
equal, up to its arithmetic)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def dense_logp(model, params, prompt, ids, temperature):
    """log softmax(logits / T) of `ids` after `prompt` under `params` (model's graph)."""
    graphdef, _ = nnx.split(model)
    seq = jnp.asarray([list(prompt) + list(ids)], jnp.int32)
    logits = nnx.merge(graphdef, params)(seq).astype(jnp.float32)[0] / temperature
    logp = jax.nn.log_softmax(logits)[len(prompt) - 1:-1]
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids)[:, None], -1)[:, 0])
