"""Pallas kernels for dspec: one package per op."""

from pallas_kernels.block_attention import (AttentionMask, BD3LMMask, CausalMask,
                                            DFlashDraftMask, DFlashTrainMask,
                                            block_attention, reference_attention)

__all__ = ['AttentionMask', 'BD3LMMask', 'CausalMask', 'DFlashDraftMask', 'DFlashTrainMask',
           'block_attention', 'reference_attention']
