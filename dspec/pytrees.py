"""Naming pytree leaves: the one spelling of a path key, for checkpoints and sharding."""

from __future__ import annotations


def key_name(key) -> str:
  """The name of one pytree path key (dict key, attribute name or sequence index)."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)
