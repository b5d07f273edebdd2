"""Flax NNX models: the target transformer and its KV cache, MTP depths and DFlash drafters."""

from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel, load_dflash, save_dflash
from dspec.models.kv_cache import KVCache
from dspec.models.mtp import MTP, MTPConfig, load_mtp, save_mtp
from dspec.models.transformer import TargetOutput, Transformer

__all__ = ['DFlashConfig', 'DFlashModel', 'KVCache', 'MTP', 'MTPConfig', 'TargetOutput',
           'Transformer', 'TransformerConfig', 'load_dflash', 'load_mtp', 'save_dflash',
           'save_mtp']
