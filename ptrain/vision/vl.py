"""A vision-language model: ptrain's decoder with Qwen2.5-VL's vision tower in front.

The prompt holds one placeholder token (`image_token_id`) per merged patch of each image.
The tower encodes the images' patches (`layout.Images`, padded to a fixed count) into one
feature row per placeholder; `image_dest` says where each row goes in the flattened
[b, t] batch (pads point past the end and are dropped), so the merge is one scatter whose
shapes do not depend on how many images a batch holds. The decoder then runs on the merged
embeddings with M-RoPE positions (`positions.batch_positions`).
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
        self.config = config
        self.text = model_lib.Transformer(config.text, rngs=rngs, mesh=mesh)
        self.vision = VisionTower(config.vision, rngs=rngs)

    def image_features(self, images: Images) -> jax.Array:
        """Tower output [n / merge_unit, d_model]; gradients stop here when the tower is
        frozen (config.vision.freeze)."""
        features = encode(self.vision, images)
        return jax.lax.stop_gradient(features) if self.config.vision.freeze else features

    def embed(self, tokens_bt, features_md, dest_m):
        """Token embeddings with feature row i written at flat position dest_m[i] of [b, t]
        (dest b*t and beyond: dropped)."""
        b, t = tokens_bt.shape
        x_btd = self.text.embed_tokens(tokens_bt)
        x_nd = x_btd.reshape(b * t, -1).at[dest_m].set(features_md.astype(x_btd.dtype),
                                                       mode="drop")
        return sharding.constrain(x_nd.reshape(b, t, -1), ("batch", "seq", None),
                                  self.text.mesh)

    def forward(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None, *,
                rope_positions_3bt=None, images: Images | None = None, image_dest_m=None,
                features_md=None):
        """(final hidden states [b, t, d], updated cache). Images come as `images` (encoded
        here) or as `features_md` already encoded (a prompt's images are encoded once and
        reused by its samples); either needs `image_dest_m`."""
        x_btd = None
        if images is not None:
            features_md = self.image_features(images)
        if features_md is not None:
            if image_dest_m is None:
                raise ValueError("image features need image_dest_m (vl.image_dest)")
            x_btd = self.embed(tokens_bt, features_md, image_dest_m)
        h_btd, new_cache, _ = self.text.forward(
            tokens_bt, positions_bt, segment_ids_bt, cache, x_btd=x_btd,
            rope_positions_3bt=rope_positions_3bt)
        return h_btd, new_cache

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None, **kw):
        """Float32 logits [b, t, v]; with a cache, `(logits, updated_cache)`."""
        h_btd, new_cache = self.forward(tokens_bt, positions_bt, segment_ids_bt, cache, **kw)
        logits_btv = jnp.einsum("btd,vd->btv", h_btd, self.text.unembedding_vd(),
                                preferred_element_type=jnp.float32)
        return logits_btv if cache is None else (logits_btv, new_cache)


def image_dest(tokens_bt: np.ndarray, image_token_id: int, n_features: int) -> np.ndarray:
    """int32 [n_features]: the flat [b, t] index of each image placeholder in order (images
    row by row, as their patches are concatenated), padded with b * t (dropped)."""
    tokens_bt = np.asarray(tokens_bt)
    where = np.flatnonzero(tokens_bt.ravel() == image_token_id)
    if len(where) > n_features:
        raise ValueError(f"{len(where)} image placeholders but room for {n_features} image "
                         "features; raise the patch budget")
    out = np.full((n_features,), tokens_bt.size, np.int32)
    out[:len(where)] = where
    return out


def init(config: VLConfig, *, seed: int = 0, mesh=None) -> VLModel:
    return sharding.create_sharded(lambda: VLModel(config, rngs=nnx.Rngs(seed), mesh=mesh),
                                   mesh)
