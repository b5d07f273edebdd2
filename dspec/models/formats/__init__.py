"""Drafter checkpoint formats: dspec's own checkpoints, z-lab DFlash / DFlash-2,
speculators (dflash, dflash2, dspark, eagle3, mtp), legacy EAGLE-3 and DeepSeek-V3 MTP
layers; one loader per drafter kind and the writers of the published forms
(`registry.DRAFTERS`)."""

from dspec.models.formats.dflash import load_dflash
from dspec.models.formats.drafter_dir import FormatError, detect
from dspec.models.formats.dspark import load_dspark
from dspec.models.formats.eagle3 import load_eagle3
from dspec.models.formats.mtp import load_mtp
from dspec.models.formats.registry import DRAFTERS, DrafterFormats, kind_of

__all__ = ['DRAFTERS', 'DrafterFormats', 'FormatError', 'detect', 'kind_of', 'load_dflash',
           'load_dspark', 'load_eagle3', 'load_mtp']
