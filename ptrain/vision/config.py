"""The vision tower's architecture (Qwen2.5-VL's `vision_config`)."""

from __future__ import annotations

import dataclasses

from ptrain import attention

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A Qwen2.5-VL vision transformer: `depth` pre-norm blocks (RMSNorm, 2-D RoPE attention
    over the patches of one image, windowed except in `fullatt_blocks`, a gated MLP with
    biases), then the merger: each 2x2 group of patches (`spatial_merge_size`) concatenated
    and projected by a 2-layer GELU MLP to the decoder's width `out_d`."""

    depth: int
    d_model: int
    n_heads: int
    d_ff: int
    out_d: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels; windows of window_size // merge // patch merged tokens
    fullatt_blocks: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tokens_per_second: int = 4  # videos only; kept for export
    param_dtype: str = "float32"
    dtype: str = "float32"
    attention_impl: str = "blockwise"
    remat: str = "none"  # none | full | dots, per block (model.REMAT_POLICIES)
    freeze: bool = False  # the learner stops gradients at the tower's output

    def __post_init__(self):
        object.__setattr__(self, "fullatt_blocks", tuple(int(i) for i in self.fullatt_blocks))
        checks = [
            (self.d_model % self.n_heads == 0,
             f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})"),
            (self.head_dim % 4 == 0,
             f"head_dim ({self.head_dim}) must be a multiple of 4 for the 2-D rotary embedding"),
            (self.hidden_act in ACTIVATIONS,
             f"hidden_act {self.hidden_act!r} is not one of {ACTIVATIONS}"),
            (all(0 <= i < self.depth for i in self.fullatt_blocks),
             f"fullatt_blocks {self.fullatt_blocks} must be block indices below depth "
             f"{self.depth}"),
            (self.window_size % (self.spatial_merge_size * self.patch_size) == 0,
             f"window_size ({self.window_size}) must be a multiple of spatial_merge_size * "
             f"patch_size ({self.spatial_merge_size * self.patch_size})"),
            (self.remat in ("none", "full", "dots"),
             f"remat {self.remat!r} is not one of none, full, dots"),
            (self.attention_impl in attention.IMPLS,
             f"attention_impl {self.attention_impl!r} is not one of {attention.IMPLS}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"VisionConfig: {message}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def patch_dim(self) -> int:
        """The length of one flattened patch: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    def replace(self, **changes) -> VisionConfig:
        return dataclasses.replace(self, **changes)
