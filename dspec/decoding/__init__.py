"""Speculative decoding: the engine, the drafter protocol and drafters, the verify-length
controller and continuous batching."""

from dspec.decoding.batching import serve
from dspec.decoding.controller import ControllerConfig, VerifyLengthController
from dspec.decoding.drafter import (Drafter, DrafterBase, HostDrafter, HostProposing,
                                    NoDrafter, StatelessDrafter)
from dspec.decoding.drafters.registry import build_drafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.sampling import SamplingSpec
from dspec.decoding.state import DecodeState, DraftContext, Proposal

__all__ = [
    'ControllerConfig', 'DecodeState', 'DraftContext', 'Drafter', 'DrafterBase',
    'HostDrafter', 'HostProposing', 'NoDrafter', 'Proposal', 'SamplingSpec',
    'SpeculativeEngine', 'StatelessDrafter', 'VerifyLengthController', 'build_drafter',
    'generated_ids', 'pad_prompts', 'serve',
]
