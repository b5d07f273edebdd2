"""Builds the drafter a decode config asks for (`cfg.drafter` + `cfg.drafters.<name>`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from dspec.decoding.drafter import NoDrafter
from dspec.decoding.drafters.ngram import NgramDrafter
from dspec.decoding.drafters.oracle import OracleDrafter
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.drafters.suffix import SuffixDrafter

# name -> builder(cfg, target, reference_BL) -> (drafter, drafter_params)
_BUILDERS: Dict[str, Callable[..., Tuple[Any, Any]]] = {}


def register(name: str):
  def wrap(fn):
    _BUILDERS[name] = fn
    return fn
  return wrap


def known() -> list:
  return sorted(_BUILDERS)


@register('none')
def _none(cfg, target, reference_BL):
  return NoDrafter(), None


@register('ngram')
def _ngram(cfg, target, reference_BL):
  c = cfg.drafters.ngram
  return NgramDrafter(num_draft=c.draft_len, min_n=c.min_n, max_n=c.max_n), None


@register('suffix')
def _suffix(cfg, target, reference_BL):
  c = cfg.drafters.suffix
  return SuffixDrafter(max_draft=c.max_draft, max_depth=c.max_depth,
                       min_token_prob=c.min_token_prob, max_spec_factor=c.max_spec_factor,
                       max_spec_offset=c.max_spec_offset,
                       max_cached_requests=c.max_cached_requests), None


@register('oracle')
def _oracle(cfg, target, reference_BL):
  c = cfg.drafters.oracle
  return (OracleDrafter(num_draft=c.draft_len, acceptance=tuple(c.acceptance),
                        vocab_size=target.cfg.vocab_size), reference_BL)


@register('self')
def _self(cfg, target, reference_BL):
  return SelfDrafter(num_draft=cfg.drafters.self.draft_len), None


@register('dflash')
def _dflash(cfg, target, reference_BL):
  from dspec.decoding.drafters import dflash
  return dflash.from_config(cfg.drafters.dflash)


@register('mtp')
def _mtp(cfg, target, reference_BL):
  from dspec.decoding.drafters import mtp
  c = cfg.drafters.mtp
  return mtp.load_mtp_drafter(c.path, c.num_depths, c.sample_proposals)


def build_drafter(cfg, target, reference_BL=None):
  """(drafter, drafter_params); ValueError naming the known drafters for a bad name."""
  if cfg.drafter not in _BUILDERS:
    raise ValueError(f'unknown drafter {cfg.drafter!r}; known: {", ".join(known())}')
  drafter, params = _BUILDERS[cfg.drafter](cfg, target, reference_BL)
  drafter.check_target(target.cfg)
  return drafter, params
