"""A vision-language model: ptrain's decoder with Qwen2.5-VL's vision tower in front.

The prompt holds one placeholder token (`image_token_id`) per merged patch of each image.
The tower encodes each row's images (`layout.Images`, padded to a fixed patch count) into
one feature row per placeholder; `image_dest` says where each goes in the row (pads point
past its end and are dropped), so the merge is one scatter whose shapes do not depend on how
many images a batch holds. The decoder then runs on the merged embeddings with M-RoPE
positions (`positions.batch_positions`).

`VLModel` answers the decoder's interface (`config` is the decoder's ModelConfig, `mesh`,
`unembedding_vd`, `forward` -> (hidden, cache, routing)), so the sampler and the learner's
programs run it as they run a Transformer; `vl_config` holds the whole VLConfig.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain import model as model_lib
from ptrain import sharding
from ptrain.vision.config import VisionConfig
from ptrain.vision.layout import Images
from ptrain.vision.tower import VisionTower, encode


@dataclasses.dataclass(frozen=True)
class VLConfig:
    text: model_lib.ModelConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    def __post_init__(self):
        if not self.text.mrope_section:
            raise ValueError("VLConfig: the decoder needs M-RoPE (text.mrope_section)")
        if self.vision.out_d != self.text.d_model:
            raise ValueError(f"VLConfig: the merger's width ({self.vision.out_d}) must be the "
                             f"decoder's d_model ({self.text.d_model})")

    def replace(self, **changes) -> VLConfig:
        return dataclasses.replace(self, **changes)


class VLModel(nnx.Module):
    def __init__(self, config: VLConfig, *, rngs: nnx.Rngs, mesh=None):
        self.vl_config = config
        self.config = config.text
        self.text = model_lib.Transformer(config.text, rngs=rngs, mesh=mesh)
        self.vision = VisionTower(config.vision, rngs=rngs)

    @property
    def mesh(self):
        return self.text.mesh

    def unembedding_vd(self) -> jax.Array:
        return self.text.unembedding_vd()

    def image_features(self, images: Images) -> jax.Array:
        """Tower output [b, n / merge_unit, d_model]; gradients stop here when the tower is
        frozen (vision.freeze)."""
        features = encode(self.vision, images)
        return jax.lax.stop_gradient(features) if self.vl_config.vision.freeze else features

    def embed(self, tokens_bt, features_bmd, dest_bm):
        """Token embeddings with row b's feature i written at its time dest_bm[b, i]
        (dest >= t: dropped)."""
        b = tokens_bt.shape[0]
        x_btd = self.text.embed_tokens(tokens_bt)
        x_btd = x_btd.at[jnp.arange(b)[:, None], dest_bm].set(
            features_bmd.astype(x_btd.dtype), mode="drop")
        return sharding.constrain(x_btd, ("batch", "seq", None), self.mesh)

    def forward(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None, *,
                replay_lbtk=None, x_btd=None, rope_positions_3bt=None,
                images: Images | None = None, image_dest_bm=None):
        """The decoder's `forward` (hidden states, updated cache, routing), with `images`
        encoded and merged at `image_dest_bm` (`image_dest`) first."""
        if images is not None:
            if image_dest_bm is None:
                raise ValueError("images need image_dest_bm (ptrain.vision.vl.image_dest)")
            x_btd = self.embed(tokens_bt, self.image_features(images), image_dest_bm)
        return self.text.forward(tokens_bt, positions_bt, segment_ids_bt, cache,
                                 replay_lbtk=replay_lbtk, x_btd=x_btd,
                                 rope_positions_3bt=rope_positions_3bt)

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None, **kw):
        """Float32 logits [b, t, v]; with a cache, `(logits, updated_cache)`."""
        h_btd, new_cache, _ = self.forward(tokens_bt, positions_bt, segment_ids_bt, cache, **kw)
        logits_btv = jnp.einsum("btd,vd->btv", h_btd, self.unembedding_vd(),
                                preferred_element_type=jnp.float32)
        return logits_btv if cache is None else (logits_btv, new_cache)


LEARNER_KEYS = ("vision_patches_bnf", "vision_rope_hw_bn2", "vision_full_seg_bn",
                "vision_window_seg_bn", "vision_dest_bm", "vision_rope_b3p", "vision_delta_b")


# Images inside the continuation (a multi-turn episode's tool observations), each row its
# own (`ptrain.rollout.images`): patches, rotary rows / columns, segments, where each merged
# feature goes in the continuation, and the continuation's M-RoPE positions [b, 3, n].
OBSERVATION_KEYS = ("vision_obs_patches_bnf", "vision_obs_rope_hw_bn2", "vision_obs_full_seg_bn",
                    "vision_obs_window_seg_bn", "vision_obs_dest_bm", "vision_rope_b3n")


def learner_inputs(model, batch: dict, group_size: int, positions_bn):
    """(prefill kwargs, continuation kwargs) of `model.forward` for a learner batch: {} and
    {} for text; with the batch's vision_* arrays (`prompts.learner_arrays`, rows first like
    every batch array), each group's prompt images encoded once and merged, and M-RoPE
    positions (the prompt's, and the continuation's positions + the rope delta). With the
    OBSERVATION_KEYS too, each row's continuation images are encoded and merged as well and
    the continuation takes its recorded M-RoPE positions."""
    present = [k for k in LEARNER_KEYS if k in batch]
    observed = [k for k in OBSERVATION_KEYS if k in batch]
    if not present and not observed:
        return {}, {}
    if (len(present) != len(LEARNER_KEYS) or observed and len(observed) != len(OBSERVATION_KEYS)
            or not isinstance(model, VLModel)):
        raise ValueError(f"a batch with images needs a VLModel and all of {LEARNER_KEYS} "
                         f"(and all or none of {OBSERVATION_KEYS}); got "
                         f"{type(model).__name__} and {present + observed}")
    g = group_size
    images = Images(batch["vision_patches_bnf"][::g], batch["vision_rope_hw_bn2"][::g],
                    batch["vision_full_seg_bn"][::g], batch["vision_window_seg_bn"][::g])
    prompt_bp = batch["prompt_bp"][::g]
    x_bpd = model.embed(prompt_bp, model.image_features(images), batch["vision_dest_bm"][::g])
    rope_3bp = jnp.moveaxis(batch["vision_rope_b3p"][::g], 1, 0)
    prompt_kw = dict(x_btd=x_bpd, rope_positions_3bt=rope_3bp)
    if not observed:
        return prompt_kw, dict(rope_positions_3bt=positions_bn + batch["vision_delta_b"][:, None])
    seen = Images(batch["vision_obs_patches_bnf"], batch["vision_obs_rope_hw_bn2"],
                  batch["vision_obs_full_seg_bn"], batch["vision_obs_window_seg_bn"])
    x_bnd = model.embed(batch["tokens_bn"], model.image_features(seen),
                        batch["vision_obs_dest_bm"])
    return prompt_kw, dict(x_btd=x_bnd,
                           rope_positions_3bt=jnp.moveaxis(batch["vision_rope_b3n"], 1, 0))


def image_dest(tokens_bt: np.ndarray, image_token_id: int, n_features: int) -> np.ndarray:
    """int32 [b, n_features]: the time of each image placeholder of each row in order (the
    row's images as their patches are concatenated), padded with t (dropped)."""
    tokens_bt = np.asarray(tokens_bt)
    b, t = tokens_bt.shape
    out = np.full((b, n_features), t, np.int32)
    for r in range(b):
        where = np.flatnonzero(tokens_bt[r] == image_token_id)
        if len(where) > n_features:
            raise ValueError(f"row {r} has {len(where)} image placeholders but room for "
                             f"{n_features} image features; raise the patch budget")
        out[r, :len(where)] = where
    return out


def init(config: VLConfig, *, seed: int = 0, mesh=None) -> VLModel:
    return sharding.create_sharded(lambda: VLModel(config, rngs=nnx.Rngs(seed), mesh=mesh),
                                   mesh)
