"""Structured output: constraints (JSON schema, regex, Lark grammar) compiled by llguidance,
and the per-row matchers whose masks the speculative verify applies."""

from dspec.structured.constraints import (KINDS, CompiledConstraint, Constraint,
                                          compile_constraint)
from dspec.structured.matcher import RowConstraints

__all__ = ['KINDS', 'CompiledConstraint', 'Constraint', 'RowConstraints',
           'compile_constraint']
