"""Output constraints: a JSON schema, a regular expression or a Lark grammar, compiled by
llguidance against the target's tokenizer.

llguidance (Rust, no torch) computes each step's allowed tokens as a packed bitmask
straight into a numpy buffer, rolls a matcher back after walking a draft, and reports the
tokens a grammar forces; those are the three operations speculative decoding needs
(`matcher.RowConstraints`). A bad or unsatisfiable constraint is a `UserError` raised here,
before anything compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional, Sequence, Union

import llguidance
import numpy as np

from dspec.errors import UserError

KINDS = ('json_schema', 'regex', 'grammar')


@dataclasses.dataclass(frozen=True)
class Constraint:
  """What the output must match. kind: json_schema (a JSON object or its text), regex (the
  whole output matches it) or grammar (Lark text, llguidance's dialect)."""

  kind: str
  source: str

  def __post_init__(self):
    if self.kind not in KINDS:
      raise UserError(f'constraint kind {self.kind!r}: expected one of {", ".join(KINDS)}')
    if not isinstance(self.source, str) or not self.source.strip():
      raise UserError(f'{self.kind}: the constraint is empty')

  @classmethod
  def of(cls, *, json_schema: Union[None, str, dict] = None, regex: Optional[str] = None,
         grammar: Optional[str] = None) -> Optional['Constraint']:
    """The one constraint given (None for none); more than one is a UserError."""
    given = {k: v for k, v in (('json_schema', json_schema), ('regex', regex),
                               ('grammar', grammar)) if v is not None}
    if len(given) > 1:
      raise UserError(f'give one constraint per row, got {" and ".join(given)}')
    if not given:
      return None
    (kind, source), = given.items()
    if kind == 'json_schema' and not isinstance(source, str):
      source = json.dumps(source)
    return cls(kind, source)

  def llguidance_grammar(self) -> str:
    try:
      if self.kind == 'json_schema':
        schema = json.loads(self.source)
        if not isinstance(schema, dict):
          raise UserError(f'json_schema: a schema is a JSON object, got {type(schema).__name__}')
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={'whitespace_flexible': False})
      if self.kind == 'regex':
        return llguidance.LLMatcher.grammar_from_regex(self.source)
      return llguidance.LLMatcher.grammar_from_lark(self.source)
    except json.JSONDecodeError as e:
      raise UserError(f'json_schema: not valid JSON ({e})') from None
    except ValueError as e:
      if isinstance(e, UserError):
        raise
      raise UserError(f'{self.kind}: {_first_line(str(e))}') from None


def _first_line(text: str) -> str:
  """llguidance's message on one line: its first line, and its `error:` line if any."""
  lines = text.strip().split('\n')
  detail = next((l.strip()[len('error:'):].strip() for l in lines[1:]
                 if l.strip().startswith('error:')), '')
  return ' '.join(lines[0].split()) + (f' ({detail})' if detail else '')


@functools.lru_cache(maxsize=8)
def _grammar_tokenizer(tokenizer_json: str, vocab_size: int, stop_ids: tuple):
  return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                eos_token=list(stop_ids))


def grammar_tokenizer(tokenizer, vocab_size: int, stop_ids: Sequence[int]):
  """llguidance's view of `tokenizer` (a Hugging Face `tokenizer.json` one) over the
  target's `vocab_size` ids, its stop ids the EOS a finished constraint allows."""
  to_json = getattr(tokenizer, 'to_json_str', None)
  if to_json is None:
    raise UserError(f'structured output needs a model with a tokenizer.json (this one has '
                    f'{type(tokenizer).__name__}: a grammar is written over text)')
  if not stop_ids:
    raise UserError('structured output needs a stop token (EOS) to end a finished '
                    'constraint; the tokenizer declares none')
  return _grammar_tokenizer(to_json(), int(vocab_size), tuple(int(i) for i in stop_ids))


@dataclasses.dataclass(frozen=True)
class CompiledConstraint:
  """A constraint checked against a tokenizer: matchers start from it (`matcher()`)."""

  constraint: Constraint
  grammar: str
  tokenizer: object   # llguidance.LLTokenizer

  def matcher(self):
    """A fresh matcher at the start of the constraint: a copy of one built once (building
    one compiles the grammar; a copy is far cheaper, which a batch of many rows needs)."""
    start = self.__dict__.get('_start')
    if start is None:
      start = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)
      object.__setattr__(self, '_start', start)
    return start.deep_copy()


def compile_constraint(constraint: Constraint, tokenizer, vocab_size: int,
                       stop_ids: Sequence[int]) -> CompiledConstraint:
  """`constraint` compiled for the target's tokenizer; UserError (one line, naming the
  kind) when it does not compile or allows no output at all."""
  grammar = constraint.llguidance_grammar()
  ll_tokenizer = grammar_tokenizer(tokenizer, vocab_size, stop_ids)
  error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
  if error and not error.startswith('WARNING'):
    raise UserError(f'{constraint.kind}: {_first_line(error)}')
  compiled = CompiledConstraint(constraint, grammar, ll_tokenizer)
  matcher = compiled.matcher()
  if matcher.is_error():
    raise UserError(f'{constraint.kind}: {_first_line(matcher.get_error())}')
  words = np.frombuffer(matcher.compute_bitmask(), np.uint32).copy()
  for i in stop_ids:
    if i // 32 < len(words):
      words[i // 32] &= ~np.uint32(1 << (i % 32))
  if not np.any(words):
    raise UserError(f'{constraint.kind}: the constraint allows no output (or only an empty '
                    'one) with this tokenizer')
  return compiled
