"""The drafters, one module each, and the registry that builds one by name from a decode
config (`build_drafter`)."""

from dspec.decoding.drafters.dflash import DFlashDrafter
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.drafters.eagle3 import Eagle3Drafter
from dspec.decoding.drafters.mtp import MTPDrafter
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.oracle import OracleDrafter
from dspec.decoding.drafters.registry import DEFAULTS, build_drafter, known, name_of
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.drafters.suffix import SuffixDrafter

__all__ = ['DEFAULTS', 'DFlashDrafter', 'DSparkDrafter', 'Eagle3Drafter', 'MTPDrafter',
           'NgramDrafter', 'OracleDrafter', 'SelfDrafter', 'SuffixDrafter', 'build_drafter',
           'known', 'name_of']
