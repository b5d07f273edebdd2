"""Flax NNX models: the target transformer and its KV cache, MTP depths, the DFlash,
DFlash-2, DSpark and EAGLE-3 drafters, and their checkpoint formats (`formats`)."""

from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel, save_dflash
from dspec.models.dflash2 import DFlash2Config, DFlash2Model
from dspec.models.dspark import DSparkConfig, DSparkModel
from dspec.models.eagle3 import Eagle3Config, Eagle3Model, save_eagle3
from dspec.models.formats import (FormatError, load_dflash, load_dspark, load_eagle3,
                                  load_mtp)
from dspec.models.kv_cache import KVCache
from dspec.models.mtp import MTP, MTPConfig, save_mtp
from dspec.models.transformer import TargetOutput, Transformer

__all__ = ['DFlash2Config', 'DFlash2Model', 'DFlashConfig', 'DFlashModel', 'DSparkConfig',
           'DSparkModel', 'Eagle3Config', 'Eagle3Model', 'FormatError', 'KVCache', 'MTP',
           'MTPConfig', 'TargetOutput', 'Transformer', 'TransformerConfig', 'load_dflash',
           'load_dspark', 'load_eagle3', 'load_mtp', 'save_dflash', 'save_eagle3',
           'save_mtp']
