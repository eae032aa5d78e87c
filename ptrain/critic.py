"""PPO's critic: the policy's decoder with a scalar value head (rl.estimator="gae").

The learner (`ptrain/learner.py`) builds it with `init`, reads its values with
`step.token_values` (aligned like the token log-probs) and trains it with a clipped value
loss (`losses.value_loss`) on the actor's minibatches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain import model as model_lib
from ptrain import sharding


class Critic(nnx.Module):
    """PPO's value function: a decoder whose final hidden states feed a scalar head (verl's
    critic, AutoModelForTokenClassification with one label: a Linear d -> 1 with a bias,
    weight ~ N(0, 0.02), bias 0). The decoder is built tied, so it carries no [v, d] output
    projection: `hidden` never reads it."""

    def __init__(self, config: model_lib.ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        self.decoder = model_lib.Transformer(config.replace(tie_embeddings=True), rngs=rngs,
                                             mesh=mesh)
        dt = jnp.dtype(config.param_dtype)
        self.value_head_d = nnx.Param(
            (0.02 * jax.random.normal(rngs.params(), (config.d_model,))).astype(dt),
            axes=("embed",))
        self.value_bias = nnx.Param(jnp.zeros((), dt), axes=())

    def values(self, h_xd):
        """Float32 values of hidden states [..., d] -> [...]."""
        w_d = self.value_head_d[...].astype(h_xd.dtype)
        return (jnp.einsum("...d,d->...", h_xd, w_d, preferred_element_type=jnp.float32)
                + self.value_bias[...].astype(jnp.float32))


def init(config: model_lib.ModelConfig, *, seed, mesh, policy_params=None):
    """(graphdef, params) of a `Critic` born sharded like the policy. policy_params: the
    decoder starts as a copy of the policy's (its output projection dropped) and only the
    value head is drawn from `seed`; None: everything is drawn from `seed`."""
    def make():
        return Critic(config, rngs=nnx.Rngs(seed), mesh=mesh)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    decoder_keys = tuple(abstract["decoder"].keys())

    def init(policy):
        critic = make()
        if policy is not None:  # the random decoder is dead code, removed by XLA
            nnx.update(critic.decoder, policy)
        return nnx.split(critic)[1]

    policy = None
    if policy_params is not None:
        policy = nnx.State({k: policy_params[k] for k in decoder_keys})
    shardings = None if mesh is None else sharding.state_shardings(abstract, mesh)
    return graphdef, jax.jit(init, out_shardings=shardings)(policy)
