"""Long-context attention (pure JAX) and evaluations; knows nothing about models."""

from long_context.blockwise import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blockwise_attention
from long_context.layouts import LAYOUTS, layout_permutation, reorder, restore
from long_context.ring_attention import ring_attention, ring_attention_shard

__all__ = [
    "DEFAULT_BLOCK_K",
    "DEFAULT_BLOCK_Q",
    "LAYOUTS",
    "blockwise_attention",
    "layout_permutation",
    "reorder",
    "restore",
    "ring_attention",
    "ring_attention_shard",
]
