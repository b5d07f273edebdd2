"""Block-sparse flash attention with computable masks (see DESIGN.md §6)."""

from pallas_kernels.block_attention.api import block_attention
from pallas_kernels.block_attention.masks import AttentionMask
from pallas_kernels.block_attention.masks import BD3LMMask
from pallas_kernels.block_attention.masks import CausalMask
from pallas_kernels.block_attention.masks import DFlashDraftMask
from pallas_kernels.block_attention.masks import DFlashTrainMask
from pallas_kernels.block_attention.masks import TreeMask
from pallas_kernels.block_attention.reference import reference_attention

__all__ = [
    'AttentionMask',
    'BD3LMMask',
    'CausalMask',
    'DFlashDraftMask',
    'DFlashTrainMask',
    'TreeMask',
    'block_attention',
    'reference_attention',
]
