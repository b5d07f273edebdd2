"""Structured output is lossless: constrained speculative decoding equals constrained AR.

Constrained AR: the target's logits masked to the tokens the constraint allows, then
temperature / top-k / top-p, renormalised at every step. (1) At T = 0 every drafter's
output equals constrained AR's token for token, on the demo target under a regex and a JSON
schema, in a ragged batch with an unconstrained row, and AR itself is the masked argmax.
(2) At T > 0 the joint law of the first 2, 3 and 4 tokens equals the constrained target's
exact law (enumerated with llguidance's own masks), chi-square over 2000 rows per
adversary: drafts always outside the grammar, a q concentrated on disallowed tokens (with
random draft counts, so forced tokens are appended past the drafter's own), drafts that are
mostly valid, and token trees whose siblings are all invalid or mixed; forced drafts on and
off. Trees at T = 0: every tree drafter equals constrained AR. The small target there has a
28-token tokenizer of its own, so the joint has a few dozen cells. (3) Bad constraints are
one ValueError before anything compiles. (4) The decode CLI.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from flax import nnx

import dspec
from conftest import REPO_ROOT
from dspec.api import Drafter
from dspec.datasets import format_gsm8k_prompt
from dspec.decoding import runner
from dspec.decoding.drafter import StatelessDrafter
from dspec.decoding.drafters.forced import ForcedTokenDrafter
from dspec.decoding.drafters.self_draft import SelfDrafter
from dspec.decoding.runner import Target
from dspec.decoding.state import Proposal
from dspec.decoding.tree import DraftTree
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
from dspec.sampling import SamplingSpec, processed_probs, sample_from_probs
from dspec.tokenizer import HFTokenizer, IdsOnlyTokenizer
from lossless_checks import chi_square_pvalue

ALPHA = 1e-3


def _llg_matcher(tokenizer, vocab_size: int, kind: str, source):
  """A plain llguidance matcher for a constraint (the test's reference, built without
  dspec.structured)."""
  lltok = llguidance.LLTokenizer(tokenizer.to_json_str(), n_vocab=vocab_size,
                                 eos_token=list(tokenizer.stop_ids))
  if kind == 'regex':
    grammar = llguidance.LLMatcher.grammar_from_regex(source)
  else:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        source, defaults={'whitespace_flexible': False})
  return llguidance.LLMatcher(lltok, grammar, log_level=0)


def _allowed(matcher, vocab_size: int) -> np.ndarray:
  """[V] bool: the tokens `matcher` allows next."""
  words = np.frombuffer(matcher.compute_bitmask(), np.uint32)
  return np.unpackbits(words.view(np.uint8), bitorder='little')[:vocab_size].astype(bool)


# ================================================= (1) T = 0 on the demo target, every drafter

DEMO = os.path.join(REPO_ROOT, 'demo')
GSM8K = r'[^#\n]{0,40}\n#### [0-9]{1,4}'
YES_NO = r'(Yes|No)\. [A-Za-z ,]{1,30}\.'
SCHEMA = {'type': 'object',
          'properties': {'name': {'type': 'string', 'maxLength': 12},
                         'age': {'type': 'integer', 'minimum': 0, 'maximum': 999}},
          'required': ['name', 'age'], 'additionalProperties': False}
# A ragged batch: two regexes, a JSON schema and an unconstrained row; prompt + MAX_NEW
# stays in one shape bucket (64), so every budget below reuses the compiled programs.
PROMPTS = [format_gsm8k_prompt('Tom has 3 apples and buys 4 more. How many apples?'),
           'A person described in JSON: ', 'def add(a, b):',
           format_gsm8k_prompt('Is 7 a prime number?')]
CONSTRAINTS = {'regex': [GSM8K, None, None, YES_NO], 'json_schema': [None, SCHEMA, None, None]}
ROW_KINDS = [('regex', GSM8K), ('json_schema', SCHEMA), None, ('regex', YES_NO)]
MAX_NEW = 40
# name: (kind, demo checkpoint); each drafts at most NUM_DRAFT tokens, as a structured
# step compiles once per verify width up to it (powers of two).
DRAFTERS = {'ngram': ('ngram', None), 'suffix': ('suffix', None),
            'grammar': ('grammar', None), 'mtp': ('mtp', 'mtp'),
            'eagle3': ('eagle3', 'eagle3'), 'dflash': ('dflash', 'dflash'),
            'dflash2': ('dflash', 'dflash2'), 'dspark': ('dspark', 'dspark')}
NUM_DRAFT = 2


@pytest.fixture(scope='module')
def demo_target():
  return dspec.load_target(os.path.join(DEMO, 'target'))


@pytest.fixture(scope='module')
def demo_drafter(demo_target):
  built = {}

  def get(name):
    if name not in built:
      kind, path = DRAFTERS[name]
      built[name] = dspec.load_drafter(kind, path and os.path.join(DEMO, path),
                                       target=demo_target,
                                       num_draft=NUM_DRAFT)
    return built[name]
  return get


@pytest.fixture(scope='module')
def reference(demo_target):
  """Constrained AR on the ragged batch."""
  return dspec.generate(demo_target, PROMPTS, max_new_tokens=MAX_NEW, **CONSTRAINTS)


def _check_matches(text: str, kind_source) -> None:
  kind, source = kind_source
  if kind == 'regex':
    assert re.fullmatch(source, text), (source, text)
  else:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {'name', 'age'}, text
    assert isinstance(value['name'], str) and len(value['name']) <= 12, text
    assert isinstance(value['age'], int) and 0 <= value['age'] <= 999, text


@pytest.mark.slow
def test_constrained_ar_is_the_masked_argmax_and_matches(demo_target, reference):
  """The reference itself: every constrained row completes its match within the budget
  and each of its tokens is the argmax of the target's logits over the tokens llguidance
  allows there (teacher-forced, one forward); the unconstrained row is plain greedy."""
  complete = reference.metrics['constraint_complete']
  assert complete == [True, True, None, True], (complete, reference.texts)
  tok = demo_target.tokenizer
  vocab = demo_target.model.cfg.vocab_size
  rows = [tok.encode(p) + ids for p, ids in zip(PROMPTS, reference.ids)]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for b, r in enumerate(rows):
    tokens[b, :len(r)] = r
  logits = np.asarray(nnx.jit(lambda m, x: m(x).logits_BTV)(demo_target.model,
                                                              jnp.asarray(tokens)))
  for b, (prompt, ids, kinds) in enumerate(zip(PROMPTS, reference.ids, ROW_KINDS)):
    start = len(tok.encode(prompt))
    matcher = kinds and _llg_matcher(tok, vocab, *kinds)
    for i, token in enumerate(ids):
      allowed = (np.ones(vocab, bool) if matcher is None else _allowed(matcher, vocab))
      row = np.where(allowed, logits[b, start + i - 1], -np.inf)
      assert allowed[token] and row[token] >= row.max() - 1e-3, (b, i, token)
      if matcher is not None:
        assert matcher.consume_token(token)
    if kinds:
      assert matcher.is_accepting() or matcher.is_stopped()
      _check_matches(reference.texts[b], kinds)
  assert len(reference.ids[2]) == MAX_NEW   # the unconstrained row runs to the budget


@pytest.mark.slow
@pytest.mark.parametrize('name', list(DRAFTERS))
def test_every_drafter_equals_constrained_ar(demo_target, demo_drafter, reference, name):
  out = dspec.generate(demo_target, PROMPTS, demo_drafter(name), max_new_tokens=MAX_NEW,
                       **CONSTRAINTS)
  assert out.ids == reference.ids, (name, out.texts, reference.texts)
  assert out.metrics['constraint_complete'] == reference.metrics['constraint_complete']
  for text, kinds in zip(out.texts, ROW_KINDS):
    if kinds:
      _check_matches(text, kinds)
  if name == 'grammar':   # JSON keys and punctuation are forced: some drafts accepted
    assert out.metrics['tau'] > 1.0


TREE_DRAFTERS = ['ngram', 'mtp', 'eagle3', 'dflash', 'dflash2', 'dspark']


@pytest.mark.slow
@pytest.mark.parametrize('name', TREE_DRAFTERS)
def test_every_tree_drafter_equals_constrained_ar(demo_target, demo_drafter, reference,
                                                  name):
  """Token trees (each drafter's own proposer, 32 nodes): every node is masked by the
  matcher state of its path; MTP also under auto_tree, which verifies the whole tree."""
  modes = ['tree', 'auto_tree'] if name == 'mtp' else ['tree']
  for mode in modes:
    out = dspec.generate(demo_target, PROMPTS, demo_drafter(name), max_new_tokens=MAX_NEW,
                         verify_length=mode, **CONSTRAINTS)
    assert out.ids == reference.ids, (name, mode, out.texts, reference.texts)
    assert out.metrics['constraint_complete'] == reference.metrics['constraint_complete']
    assert out.metrics['nodes_verified_per_step'] > 1.0


@pytest.mark.slow
def test_forced_drafts_off_fixed_verify_and_a_short_budget(demo_target, demo_drafter,
                                                           reference):
  """forced_drafts=False and verify_length fixed give the same tokens; a budget too small
  for any match ends incomplete, with constrained AR's tokens so far (T = 0: a prefix)."""
  mtp = demo_drafter('mtp')
  for kw in ({'forced_drafts': False}, {'verify_length': 'fixed'}):
    out = dspec.generate(demo_target, PROMPTS, mtp, max_new_tokens=MAX_NEW, **kw,
                         **CONSTRAINTS)
    assert out.ids == reference.ids, kw
  short = dspec.generate(demo_target, PROMPTS, mtp, max_new_tokens=6, compare_ar=True,
                         **CONSTRAINTS)
  assert short.metrics['constraint_complete'] == [False, False, None, False]
  assert short.metrics['lossless'] is True
  assert short.ids == [ids[:6] for ids in reference.ids]


# ================================== (2) T > 0: exact chi-square of the constrained joint law

# A 28-token byte-level BPE: the characters below, a few merges (' is', ' was', 'as', ...)
# and the stop token <|endoftext|> (id 0).
SMALL_CHARS = 'abcisw012 Zxyz:Q'
SMALL_MERGES = [('Ġ', 'i'), ('i', 's'), ('Ġi', 's'), ('Ġ', 'w'), ('a', 's'), ('Ġw', 'as'),
                ('a', 'b'), ('1', '2'), ('Ġ', '1'), ('x', 'y'), ('xy', 'z')]
# Small allowed sets, several tokenizations of ' is' / ' was' (after ' i' and ' w' the rest
# is forced), the end (EOS or 'c') inside the window.
CHI_REGEX = r'[ab]( is| was)[0-2]c?'
CHI_PROMPT = 'Q: '
CHI_TOKENS = 4      # every generated token: the joint of 4, and of the first 2 and 3
CHI_ROWS = 2000


def _byte_chars() -> dict:
  """GPT-2's byte -> printable character map (what a ByteLevel vocabulary is written in)."""
  keep = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
          + list(range(ord('®'), ord('ÿ') + 1)))
  chars, extra = dict(zip(keep, keep)), 0
  for b in range(256):
    if b not in chars:
      chars[b], extra = 256 + extra, extra + 1
  return {b: chr(c) for b, c in chars.items()}


def _small_tokenizer(directory) -> HFTokenizer:
  import tokenizers
  byte_char = _byte_chars()
  vocab = {'<|endoftext|>': 0}
  for c in SMALL_CHARS:
    vocab[byte_char[ord(c)]] = len(vocab)
  for a, b in SMALL_MERGES:
    vocab[a + b] = len(vocab)
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=SMALL_MERGES))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                          use_regex=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens(['<|endoftext|>'])
  tok.save(os.path.join(directory, 'tokenizer.json'))
  return HFTokenizer(str(directory))


@pytest.fixture(scope='module')
def small(tmp_path_factory):
  """A random 2-layer target over the 28-token tokenizer (logits scaled so the masked
  next-token laws are neither flat nor one-hot)."""
  tokenizer = _small_tokenizer(tmp_path_factory.mktemp('small_tokenizer'))
  assert tokenizer.stop_ids == (0,)
  cfg = TransformerConfig(vocab_size=tokenizer.vocab_size, num_layers=2, embed_dim=32,
                          num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                          tie_embeddings=False)
  model = Transformer(cfg, rngs=nnx.Rngs(5))
  model.lm_head[...] = model.lm_head[...] * 2.0
  return Target(model, tokenizer, max_seq_len=64)


@functools.partial(nnx.jit, static_argnames=('spec',))
def _masked_next_probs(model, seqs, last, allowed, spec, temperature, top_p):
  logits = model(seqs).logits_BTV[jnp.arange(seqs.shape[0]), last]
  return processed_probs(jnp.where(allowed, logits, -jnp.inf), spec, temperature, top_p)


_JOINTS = {}


def exact_joint(target: Target, temperature: float, top_p: float) -> dict:
  """{token tuple of CHI_TOKENS (after a stop, stop ids): probability} of constrained AR:
  prefixes enumerated depth by depth, each one's allowed tokens from a fresh llguidance
  matcher, the target's logits there masked, then processed and renormalised."""
  key = (id(target), temperature, top_p)
  if key in _JOINTS:
    return _JOINTS[key]
  tok, vocab = target.tokenizer, target.model.cfg.vocab_size
  spec = SamplingSpec.create(temperature, 0, top_p)
  prompt = tok.encode(CHI_PROMPT)
  rows = 64   # one padded batch per depth: one compiled program
  frontier = {(): 1.0}
  for depth in range(CHI_TOKENS):
    live = [p for p in frontier if not (p and p[-1] == 0)]
    nxt = {p + (0,): pr for p, pr in frontier.items() if p and p[-1] == 0}
    assert len(live) <= rows
    seqs = np.zeros((rows, len(prompt) + CHI_TOKENS), np.int32)
    allowed = np.ones((rows, vocab), bool)
    for i, p in enumerate(live):
      seqs[i, :len(prompt) + depth] = prompt + list(p)
      matcher = _llg_matcher(tok, vocab, 'regex', CHI_REGEX)
      assert matcher.consume_tokens(list(p))
      allowed[i] = _allowed(matcher, vocab)
    probs = np.asarray(_masked_next_probs(
        target.model, jnp.asarray(seqs), jnp.full((rows,), len(prompt) + depth - 1),
        jnp.asarray(allowed), spec, jnp.float32(temperature), jnp.float32(top_p)),
                       np.float64)
    for i, p in enumerate(live):
      for t in np.nonzero(probs[i])[0]:
        assert allowed[i, t]
        nxt[p + (int(t),)] = frontier[p] * probs[i, t]
    frontier = nxt
  assert abs(sum(frontier.values()) - 1.0) < 1e-5
  _JOINTS[key] = frontier
  return frontier


def _grammar_tokens(target) -> tuple:
  return tuple(sorted({t for cell in exact_joint(target, 1.0, 1.0) for t in cell if t}))


def _invalid_tokens(target) -> tuple:
  """Tokens the constraint never allows: 'Z', 'xyz', ':'."""
  return tuple(target.tokenizer.token_to_id(t) for t in ('Z', 'xyz', ':'))


@dataclasses.dataclass(frozen=True)
class OutsideDrafter(StatelessDrafter):
  """Every draft is `token`, which the grammar never allows (deterministic drafts)."""

  num_draft: int = 2
  token: int = 0

  def propose(self, params, state, target, ctx, key):
    b = ctx.tokens_BL.shape[0]
    return Proposal(jnp.full((b, self.num_draft), self.token, jnp.int32),
                    jnp.full((b,), self.num_draft, jnp.int32))


@dataclasses.dataclass(frozen=True)
class StochasticDrafter(SelfDrafter):
  """Two adversaries with a real q, by row parity (one compiled program for both).

  Even rows, 'invalid_q': each draft sampled from a fixed q with 80% of its mass on tokens
  the grammar never allows and the rest on the grammar's tokens (valid or not where they
  land), and a random number of drafts (0..num_draft), so the host appends forced drafts
  past them. Odd rows, 'mostly_valid': the target drafting itself (q = its processed law)
  over the grammar's token set, unaware of the per-position masks: drafts mostly valid,
  accepted often."""

  good: tuple = ()
  bad: tuple = ()
  bad_mass: float = 0.8

  def propose(self, params, cache, target, ctx, key):
    b, vocab = ctx.tokens_BL.shape[0], target.cfg.vocab_size
    keep_V = jnp.zeros((vocab,), bool).at[jnp.asarray(self.good)].set(True)
    fixed_V = (jnp.zeros((vocab,), jnp.float32)
               .at[jnp.asarray(self.bad)].add(self.bad_mass / len(self.bad))
               .at[jnp.asarray(self.good)].add((1 - self.bad_mass) / len(self.good)))
    invalid_q_B = jnp.arange(b) % 2 == 0
    token_B = ctx.tokens_BL[jnp.arange(b), ctx.num_tokens_B - 1]
    drafts, qs = [], []
    for j in range(self.num_draft):
      out = target(token_B[:, None], cache=cache)
      cache = out.cache.with_lengths(cache.lengths_B + 1)
      q_BV = processed_probs(jnp.where(keep_V, out.logits_BTV[:, 0], -jnp.inf),
                             ctx.sampling, ctx.temperature, ctx.top_p)
      q_BV = jnp.where(invalid_q_B[:, None], fixed_V, q_BV)
      token_B = sample_from_probs(jax.random.fold_in(key, j), q_BV)
      drafts.append(token_B)
      qs.append(q_BV)
    random_num_B = jax.random.randint(jax.random.fold_in(key, self.num_draft), (b,), 0,
                                      self.num_draft + 1)
    num_B = jnp.where(invalid_q_B, random_num_B, self.num_draft)
    return Proposal(jnp.stack(drafts, axis=1), num_B.astype(jnp.int32),
                    jnp.stack(qs, axis=1))


@dataclasses.dataclass(frozen=True)
class FixedTrees:
  """Deterministic trees of fixed tokens, by row parity. Even rows, 'invalid_siblings': the
  root's children are every token the grammar never allows. Odd rows, 'mixed': six of the
  grammar's tokens and the invalid ones interleaved under the root, under each of the
  first four of them an invalid token and two grammar tokens, and under each of those a
  grammar token (30 nodes): a node's mask must be its own path's."""

  good: tuple
  bad: tuple

  def _shape(self, mixed: bool) -> tuple:
    if not mixed:
      return [0] + list(self.bad), [-1] + [0] * len(self.bad)
    tokens, parents = [0], [-1]

    def add(token, parent):
      tokens.append(token)
      parents.append(parent)
      return len(tokens) - 1
    firsts = [t for pair in zip(self.good, self.bad) for t in pair] + list(self.good[3:6])
    depth1 = [add(t, 0) for t in firsts]
    for node in depth1[:4]:
      for t in (self.bad[0], self.good[0], self.good[-1]):
        child = add(t, node)
        if t != self.bad[0]:
          add(self.good[1], child)
    return tokens, parents

  def propose_tree(self, drafter, params, state, target, ctx, key, num_nodes):
    del drafter, params, state, target, key
    shapes = [self._shape(mixed) for mixed in (False, True)]
    n = max(len(t) for t, _ in shapes)
    assert n <= num_nodes, (n, num_nodes)
    pad = lambda xs, fill: np.asarray(xs + [fill] * (n - len(xs)), np.int32)
    tokens_2N = np.stack([pad(t, 0) for t, _ in shapes])
    parents_2N = np.stack([pad(p, -1) for _, p in shapes])
    parity_B = jnp.arange(ctx.tokens_BL.shape[0]) % 2
    return DraftTree(jnp.asarray(tokens_2N)[parity_B], jnp.asarray(parents_2N)[parity_B],
                     jnp.asarray([len(t) for t, _ in shapes], jnp.int32)[parity_B])


@dataclasses.dataclass(frozen=True)
class TreeAdversary(OutsideDrafter):
  """`FixedTrees` under tree verification (its chain: `OutsideDrafter`'s)."""

  good: tuple = ()
  bad: tuple = ()

  def tree_proposer(self, top_k: int):
    del top_k
    return FixedTrees(self.good, self.bad)


def _chi_drafter(name: str, target):
  if name == 'outside':
    return OutsideDrafter(num_draft=2, token=_invalid_tokens(target)[0])
  if name == 'trees':
    return TreeAdversary(num_draft=3, token=_invalid_tokens(target)[0],
                         good=_grammar_tokens(target), bad=_invalid_tokens(target))
  assert name == 'stochastic'
  return StochasticDrafter(num_draft=2, good=_grammar_tokens(target),
                           bad=_invalid_tokens(target))


def _pvalues(samples: list, joint: dict) -> dict:
  """Chi-square p-value of the joint of the first d tokens, d = 2, 3, CHI_TOKENS."""
  out = {}
  for d in (2, 3, CHI_TOKENS):
    law = {}
    for cell, p in joint.items():
      law[cell[:d]] = law.get(cell[:d], 0.0) + p
    cells = list(law)
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells) + 1)   # the last cell: anything the law gives 0
    for s in samples:
      counts[index.get(s[:d], len(cells))] += 1
    out[d] = chi_square_pvalue(counts, [law[c] for c in cells] + [0.0])
  return out


# (drafter, temperature, top_p): each case runs with forced drafts on and off (one compile).
# With them off, 'outside' makes the same draws as AR (its draft is rejected with p = 0, the
# residual is p itself), so it is AR's check too.
CHI_CASES = [('outside', 0.7, 0.9), ('stochastic', 1.0, 1.0), ('stochastic', 0.7, 0.9)]


@pytest.mark.slow
@pytest.mark.parametrize('temperature,top_p', [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_joint_of_adversarial_trees_equals_the_constrained_target(small, temperature,
                                                                          top_p):
  """Tree verification under a constraint (`FixedTrees`): siblings all invalid, and
  grammar and invalid tokens mixed over three depths."""
  prompt = small.tokenizer.encode(CHI_PROMPT)
  out = dspec.generate(small, [prompt] * (CHI_ROWS * 2), Drafter('trees', _chi_drafter(
      'trees', small)), regex=CHI_REGEX, max_new_tokens=CHI_TOKENS, temperature=temperature,
                       top_p=top_p, seed=2, verify_length='tree')
  joint = exact_joint(small, temperature, top_p)
  for i, group in enumerate(['invalid_siblings', 'mixed']):
    samples = [tuple(ids) + (0,) * (CHI_TOKENS - len(ids)) for ids in out.ids[i::2]]
    pvalues = _pvalues(samples, joint)
    tau = np.mean([m['tau'] for m in out.per_prompt[i::2]])
    print(f'{group} T={temperature} top_p={top_p}: p(joint of d tokens) '
          + ' '.join(f'{d}: {p:.3g}' for d, p in pvalues.items()) + f'  tau={tau:.3f}')
    assert min(pvalues.values()) > ALPHA, (group, pvalues)
    assert (tau > 1.1) if group == 'mixed' else (tau == 1.0)   # mixed: paths accepted


@pytest.mark.slow
@pytest.mark.parametrize('forced', [True, False], ids=['forced', 'unforced'])
@pytest.mark.parametrize('name,temperature,top_p', CHI_CASES)
def test_sampled_joint_equals_the_constrained_target(small, name, temperature, top_p,
                                                     forced):
  groups = {'outside': ['outside'], 'stochastic': ['invalid_q', 'mostly_valid']}[name]
  prompt = small.tokenizer.encode(CHI_PROMPT)
  out = dspec.generate(small, [prompt] * (CHI_ROWS * len(groups)),
                       Drafter(name, _chi_drafter(name, small)), regex=CHI_REGEX,
                       max_new_tokens=CHI_TOKENS, temperature=temperature, top_p=top_p,
                       seed=1, forced_drafts=forced)
  joint = exact_joint(small, temperature, top_p)
  for i, group in enumerate(groups):
    samples = [tuple(ids) + (0,) * (CHI_TOKENS - len(ids))
               for ids in out.ids[i::len(groups)]]
    pvalues = _pvalues(samples, joint)
    tau = np.mean([m['tau'] for m in out.per_prompt[i::len(groups)]])   # per row
    print(f'{group} T={temperature} top_p={top_p} forced={forced}: p(joint of d tokens) '
          + ' '.join(f'{d}: {p:.3g}' for d, p in pvalues.items()) + f'  tau={tau:.3f}')
    assert min(pvalues.values()) > ALPHA, (group, pvalues)
    if group != 'outside' or forced:
      assert tau > 1.0   # drafts were accepted (the test sees their law)
  # `constraint_complete` says exactly which outputs are a whole match.
  complete = out.metrics['constraint_complete']
  assert complete == [re.fullmatch(CHI_REGEX, t) is not None for t in out.texts]
  assert 0.3 < np.mean(complete) < 1.0


def _packed(allowed_NV) -> np.ndarray:
  """Packed int32 bitmasks [..., W] of bool masks [..., V] (bit v % 32 of word v // 32)."""
  allowed_NV = np.asarray(allowed_NV, bool)
  words = np.zeros(allowed_NV.shape[:-1] + ((allowed_NV.shape[-1] + 31) // 32,), np.uint32)
  for v in np.nonzero(allowed_NV.reshape(-1, allowed_NV.shape[-1]).any(0))[0]:
    words[..., v // 32] |= allowed_NV[..., v].astype(np.uint32) << np.uint32(v % 32)
  return words.view(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize('temperature,top_p', [(1.0, 1.0), (0.7, 0.9)])
def test_forced_draft_laws_are_exact_where_the_forced_token_has_rivals(temperature, top_p):
  """The law `_constrained_q` gives the verifier, where llguidance never puts it to the
  test: there a forced position allows the forced token alone, so p(forced) = 1 and any q
  accepts it. Here the forced token f has rivals: (i) the drafter's own draft, sampled
  from a q with 80% on disallowed tokens and replaced by f when disallowed, has law q on
  the allowed tokens plus the rest on f; (ii) a forced draft appended past the drafter's
  own is one-hot whatever the drafter's q there. Exact values, then the first emitted
  token of 50k verifies against the masked target (chi-square)."""
  from dspec.decoding import engine
  from dspec.decoding.state import StepMasks
  from dspec.decoding.verification import rejection_verify_logits
  v, n, f = 6, 50_000, 1
  allowed_V = np.array([1, 1, 1, 0, 0, 0], bool)
  q_V = np.array([0.05, 0.05, 0.10, 0.40, 0.40, 0.0], np.float32)
  logits_V = np.log(np.array([0.5, 0.2, 0.3, 0.6, 0.3, 0.1], np.float32))
  spec = SamplingSpec.create(temperature, 0, top_p)
  probs = lambda x: processed_probs(x, spec, jnp.float32(temperature), jnp.float32(top_p))
  p_V = np.asarray(probs(jnp.where(allowed_V, logits_V, -jnp.inf)[None]))[0]
  key_draft, key_verify = jax.random.split(jax.random.key(11))
  drafted = np.asarray(sample_from_probs(key_draft, jnp.broadcast_to(q_V, (n, v))))
  for own in (1, 0):
    # (i) own = 1: the drafter's draft, f where it is disallowed; (ii) own = 0: f appended.
    tokens = np.where(allowed_V[drafted], drafted, f) if own else np.full((n,), f)
    proposal = Proposal(jnp.asarray(tokens[:, None], jnp.int32), jnp.ones((n,), jnp.int32),
                        jnp.broadcast_to(q_V, (n, 1, v)))
    masks = StepMasks(jnp.asarray(_packed(np.broadcast_to(allowed_V, (n, 2, v)))),
                      jnp.full((n, 1), f, jnp.int32), jnp.full((n,), own, jnp.int32))
    law_V = np.asarray(engine._constrained_q(proposal, masks)[0, 0])
    want_V = (np.where(allowed_V, q_V, 0) + (1 - q_V[allowed_V].sum()) * np.eye(v)[f]
              if own else np.eye(v)[f])
    np.testing.assert_allclose(law_V, want_V, atol=1e-6)
    logits = engine.mask_logits(jnp.broadcast_to(jnp.asarray(logits_V), (n, 2, v)),
                                masks.allowed_BG1W)
    _, emitted = rejection_verify_logits(key_verify, proposal.tokens_BG,
                                         proposal.num_proposed_B,
                                         engine._constrained_q(proposal, masks), logits, probs)
    counts = np.bincount(np.asarray(emitted[:, 0]), minlength=v)
    pvalue = chi_square_pvalue(counts, p_V)
    print(f'forced draft law, own={own} T={temperature} top_p={top_p}: p={pvalue:.3g}')
    assert pvalue > ALPHA, (own, counts / n, p_V)


# ====================================================== (3) bad input: one clear ValueError

@pytest.fixture
def no_compile(monkeypatch):
  """Fails the test if a generation starts (an error must come before any compile)."""
  def refuse(*args, **kwargs):
    raise AssertionError('a generation started before the error')
  monkeypatch.setattr(runner, 'timed_generations', refuse)


BAD = {
    'invalid_regex': ({'regex': '[0-9'}, 'regex: '),
    'invalid_json': ({'json_schema': '{"type": "object",'}, 'json_schema: not valid JSON'),
    'non_object_schema': ({'json_schema': '[1, 2]'}, 'a schema is a JSON object'),
    'only_the_empty_output': ({'regex': 'a{0}'}, 'allows no output'),
    'not_in_the_vocabulary': ({'regex': 'k+'}, 'allows no output'),   # no token has a 'k'
    'empty': ({'regex': ''}, 'the constraint is empty'),
    'two_for_one_row': ({'regex': '[0-9]+', 'json_schema': SCHEMA},
                        'give one constraint per row'),
    'list_of_wrong_length': ({'regex': ['[0-9]+']}, 'one entry (or None) per prompt (2)'),
    'unknown_json_keyword_type': ({'json_schema': {'type': 'nonsense'}}, 'json_schema: '),
}


@pytest.mark.parametrize('case', list(BAD))
def test_bad_constraint_is_one_value_error(small, no_compile, case):
  kwargs, expected = BAD[case]
  prompt = small.tokenizer.encode(CHI_PROMPT)
  with pytest.raises(ValueError) as e:
    dspec.generate(small, [prompt, prompt], max_new_tokens=4, **kwargs)
  message = str(e.value)
  assert expected in message and '\n' not in message, message


def test_modes_that_cannot_take_a_constraint_are_refused(small, no_compile):
  prompt = small.tokenizer.encode(CHI_PROMPT)
  grammar = Drafter('grammar', ForcedTokenDrafter(num_draft=3))
  with pytest.raises(ValueError, match='drafts only the tokens a constraint forces'):
    dspec.generate(small, [prompt], grammar, max_new_tokens=4)
  ids_only = Target(small.model, IdsOnlyTokenizer(small.model.cfg.vocab_size,
                                                  eos_ids=(0,)), 64)
  with pytest.raises(ValueError, match='needs a model with a tokenizer.json'):
    dspec.generate(ids_only, [prompt], max_new_tokens=4, regex=CHI_REGEX)
  # None everywhere is no constraint at all (plain decoding), not an error.
  assert runner.constrained_run(small, [None], 1, 'auto', None, True) is None


# ============================================================================ (4) the CLI

DECODE = os.path.join(REPO_ROOT, 'scripts', 'decode.py')
CLI_PROMPT = format_gsm8k_prompt('Is 7 a prime number?')


def _decode_cli(*args):
  # The grammar drafter, 2 drafts, no AR comparison: few compiles on the demo target.
  proc = subprocess.run([sys.executable, DECODE, '--config=configs/demo.py:small',
                         '--config.drafter=grammar', '--config.drafters.grammar.num_draft=2',
                         '--config.compare_ar=False',
                         f'--prompt={CLI_PROMPT}', *args], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=600)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_regex_output_matches():
  rc, stdout, stderr = _decode_cli(f'--regex={YES_NO}', '--config.max_new_tokens=16',
                                   '--config.timing_repeats=0')
  assert rc == 0, stderr[-2000:]
  text = stdout.split('----- continuation -----\n', 1)[1].split('\n------------------------',
                                                                1)[0]
  assert re.fullmatch(YES_NO, text), text
  metrics = [line for line in stdout.splitlines() if line.startswith('metrics: ')]
  assert len(metrics) == 1
  assert 'method=grammar' in metrics[0] and 'constraint_complete=[True]' in metrics[0], metrics


@pytest.mark.multiprocess
def test_cli_bad_regex_is_one_error_line():
  rc, _, stderr = _decode_cli('--regex=[0-9', '--config.max_new_tokens=16')
  assert rc == 1 and 'Traceback' not in stderr
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and errors[0].startswith('error: regex: '), stderr[-2000:]
