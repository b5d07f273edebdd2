"""Tests for dspec/decoding/drafters/suffix.py: trie counts, speculation, caches, lossless."""

import random

import jax
import numpy as np
import pytest

from dspec.decoding.drafters.suffix import (SharedSuffixCache, SuffixCache, SuffixDrafter,
                                            SuffixTree, speculate)
from conftest import generate
from dspec import compiled_programs
from dspec.decoding import runner
from dspec.decoding.costs import CostTable
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.host_loop import HostSession, verify_width
from dspec.decoding.policy import ControllerConfig
from dspec.decoding.prompts import generated_ids, pad_prompts
from dspec.decoding.state import Proposal


def _all_counts(tree):
  """{path: count} for every node below the root."""
  out, stack = {}, [((), tree.ROOT)]
  while stack:
    path, node = stack.pop()
    for token, child in tree.children(node).items():
      out[path + (token,)] = tree.count(path + (token,))
      stack.append((path + (token,), child))
  return out


def _brute_counts(seqs, max_depth):
  out = {}
  for seq in seqs:
    for start in range(len(seq)):
      for end in range(start + 1, min(len(seq), start + max_depth) + 1):
        key = tuple(seq[start:end])
        out[key] = out.get(key, 0) + 1
  return out


def test_trie_counts_match_brute_force():
  rng = random.Random(0)
  seqs = [[rng.randrange(3) for _ in range(n)] for n in (30, 17, 1)]
  tree = SuffixTree(max_depth=5)
  for i, seq in enumerate(seqs):
    tree.extend(i, seq)
  assert _all_counts(tree) == _brute_counts(seqs, 5)
  assert tree.count([]) == sum(len(s) for s in seqs)

  small = SuffixTree(max_depth=3)
  small.extend(0, [1, 2, 3, 1, 2, 4])
  assert (small.count([1, 2]), small.count([1, 2, 3]), small.count([2, 3, 1])) == (2, 1, 1)
  assert small.count([1, 2, 3, 1]) == 0 and small.find([1, 2, 3, 1]) is None


def test_remove_undoes_a_sequence():
  rng = random.Random(1)
  keep, drop = ([rng.randrange(4) for _ in range(n)] for n in (25, 40))
  tree = SuffixTree(max_depth=6)
  tree.extend(0, keep)
  tree.extend(1, drop)
  tree.remove(1)
  assert _all_counts(tree) == _brute_counts([keep], 6)
  assert tree.num_nodes == 1 + len(_brute_counts([keep], 6))   # emptied nodes released
  tree.extend(2, drop)   # reuses the released nodes
  assert _all_counts(tree) == _brute_counts([keep, drop], 6)
  tree.remove(2)
  tree.remove(0)
  assert tree.count([]) == 0 and not tree.children(tree.ROOT)


def test_speculate_continues_a_repeating_context():
  context = [1, 2, 3, 4] * 2 + [1, 2, 3]
  tree = SuffixTree(max_depth=16)
  tree.extend(0, context)
  # m = 4…7 (e.g. '1 2 3 4 1 2 3') match once before the current occurrence.
  assert speculate(tree, context, max_draft=8) == ([4, 1, 2, 3], 4.0)
  # The current occurrence ends where drafting starts: it must not dilute probabilities.
  tokens, score = speculate(tree, context, max_draft=8, max_spec_offset=5.0)
  assert tokens == [4, 1, 2, 3, 4, 1, 2, 3] and score == 8.0


def test_min_token_prob_truncates_uncertain_continuations():
  tree = SuffixTree(max_depth=8)
  for i, seq in enumerate([[7, 1, 2], [7, 1, 2], [7, 1, 3], [7, 4, 4]]):
    tree.extend(i, seq)
  # After 7: 1 with p = 3/4, then 2 with p = 3/4 · 2/3 = 1/2.
  kw = dict(max_draft=8, max_spec_offset=4.0)
  assert speculate(tree, [7], min_token_prob=0.6, **kw) == ([1], 0.75)
  tokens, score = speculate(tree, [5, 7], min_token_prob=0.4, **kw)
  assert tokens == [1, 2] and score == pytest.approx(1.25)


def test_draft_length_is_capped_by_match_length():
  tree = SuffixTree(max_depth=32)
  tree.extend(0, list(range(20)))
  context = [0, 1, 2, 3]   # m = 4: at most floor(0.5 · 4 + 1) = 3 tokens
  kw = dict(max_spec_factor=0.5, max_spec_offset=1.0)
  assert speculate(tree, context, max_draft=8, **kw) == ([4, 5, 6], 3.0)
  assert speculate(tree, context, max_draft=2, **kw) == ([4, 5], 2.0)
  assert speculate(tree, context, max_draft=8) == ([4, 5, 6, 7], 4.0)
  assert speculate(tree, [0, 1, 2, 3], max_draft=8, max_spec_factor=0.0) == ([], 0.0)


@pytest.mark.parametrize('vocab,depth', [(3, 4), (8, 6)])   # matches to the cap; short
def test_context_nodes_kept_as_a_request_grows_equal_fresh_lookups(vocab, depth):
  """The per-request trie's context nodes (kept by `append`) and the global trie's (kept
  as tokens arrive, found afresh after the global trie changes) equal `suffix_nodes`
  lookups, so drafts equal `speculate` over each trie (the per-request trie wins ties)."""
  rng = random.Random(2)
  tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]
  cache = SuffixCache(max_depth=depth, max_cached_requests=3)
  for _ in range(3):
    cache.cache_output(tokens(40))
  request = cache.start_request(tokens(5))
  for step in range(60):
    if step % 20 == 10:
      cache.cache_output(tokens(60))   # the global trie changes mid-request (an eviction)
    cache.add_tokens(request, tokens(rng.randrange(1, 3)))
    context = request.tokens[-depth:]
    assert request.tree.own_suffix_nodes(0) == request.tree.suffix_nodes(context)
    assert cache._global_nodes(request) == cache.global_tree.suffix_nodes(context)
    own, other = (speculate(t, context, 4) for t in (request.tree, cache.global_tree))
    assert cache.speculate(request, 4) == (other if other[1] > own[1] else own)


def test_speculation_stops_at_the_first_match_with_no_continuation():
  """`speculate` stops at the first match length whose node has no children; its drafts
  equal those of scoring every match length (random tries, after evictions too)."""
  rng = random.Random(3)

  def every_match(tree, context, max_draft):
    best = ([], 0.0)
    for m, node in enumerate(tree.suffix_nodes(context), 1):
      drafted = tree.most_frequent_path(node, min(max_draft, m), 0.1)
      best = drafted if drafted[1] >= best[1] else best
    return best

  for vocab in (2, 3, 6):
    tree = SuffixTree(max_depth=8)
    for i in range(6):
      tree.extend(i, [rng.randrange(vocab) for _ in range(rng.randrange(5, 40))])
    tree.remove(1)
    for _ in range(40):
      context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
      assert speculate(tree, context, 6) == every_match(tree, context, 6)


def test_global_tree_serves_a_later_request():
  cache = SuffixCache(max_depth=8, max_cached_requests=4)
  first = cache.start_request([1, 2, 3])
  cache.add_tokens(first, [10, 11, 12, 13, 14, 15])
  assert cache.speculate(first, max_draft=4) == ([], 0.0)
  cache.stop_request(first)
  assert cache.num_cached == 1
  second = cache.start_request([4, 5, 10, 11])
  assert cache.speculate(second, max_draft=4) == ([12, 13], 2.0)
  no_global = SuffixCache(max_depth=8, max_cached_requests=0)
  no_global.cache_output([10, 11, 12, 13])
  assert no_global.speculate(no_global.start_request([10, 11]), max_draft=4) == ([], 0.0)


def test_fifo_eviction_decrements_counts():
  cache = SuffixCache(max_depth=4, max_cached_requests=2)
  cache.cache_output([1, 2, 3])
  cache.cache_output([1, 2, 4])
  assert cache.global_tree.count([1, 2]) == 2
  cache.cache_output([5, 6])
  tree = cache.global_tree
  assert cache.num_cached == 2
  assert (tree.count([1, 2]), tree.count([1, 2, 4]), tree.count([5, 6])) == (1, 1, 1)
  assert tree.find([1, 2, 3]) is None and tree.find([3]) is None
  assert _all_counts(tree) == _brute_counts([[1, 2, 4], [5, 6]], 4)


def test_repeated_runs_start_from_the_same_cache_state():
  shared = SharedSuffixCache(SuffixCache(max_depth=8, max_cached_requests=10))
  prompts, outputs = [[1, 2], [3]], [[5, 6, 7], [8, 9]]
  for _ in range(3):   # warm-up + timed repeats of one prompt batch
    shared.begin_run(prompts)
    assert shared.cache.num_cached == 0
    shared.end_run(prompts, outputs)
  shared.begin_run([[4]])
  assert shared.cache.num_cached == 2 and shared.cache.global_tree.count([6, 7]) == 1

  drafter = SuffixDrafter(cache_id='test_repeated_runs')
  assert drafter.shared_cache() is drafter.shared_cache()
  private = SuffixDrafter(cache_id='test_repeated_runs', use_global_cache=False)
  assert private.shared_cache() is not private.shared_cache()
  assert len({drafter, private}) == 2 and drafter.num_draft == 16
  assert drafter.shared_cache(private=True) is not drafter.shared_cache()


def test_host_drafter_pads_proposals():
  host = SuffixDrafter(num_draft=4, max_spec_offset=4.0, use_global_cache=False,
                       cache_id='test_host_pads').host_drafter_factory()()
  sequences = [[1, 2, 3, 1, 2], [9, 9, 9]]
  host.start(sequences)
  tokens_BG, num_B = host.propose(sequences, np.array([True, False]))
  assert tokens_BG.shape == (2, 4) and tokens_BG.dtype == np.int32
  assert num_B.tolist() == [3, 0] and tokens_BG[0, :3].tolist() == [3, 1, 2]
  sequences[0] += [3]
  tokens_BG, num_B = host.propose(sequences, np.array([True, True]))
  assert tokens_BG[0, :num_B[0]].tolist() == [1, 2, 3]   # only what was seen after '3'
  assert tokens_BG[1, :num_B[1]].tolist() == [9, 9]


# ------------------------------------------------------------------ end to end


_PROMPTS = [[3, 4, 5, 6] * 5, [7, 8, 9] * 3 + [10, 11]]
_NEW = 40


def _ar_ids(tiny_split, prompts=_PROMPTS, max_new=_NEW):
  ar = runner.speculative_engine(tiny_split[0])
  state = ar.prefill(tiny_split[1], None, *pad_prompts(prompts), max_new_tokens=max_new)
  return generated_ids(ar.generate(tiny_split[1], None, state))


def _paying(batch: int, gamma: int, per_token: float = 0.05) -> CostTable:
  """Step costs under which every tier could pay (no profiling in unit tests)."""
  tiers = (0, 1, 3, gamma)
  return CostTable({(batch, g): 1.0 + per_token * g for g in tiers}, {batch: 0.0})


@pytest.mark.slow
@pytest.mark.parametrize('prompts', [_PROMPTS[:1], _PROMPTS], ids=['batch1', 'batch2'])
@pytest.mark.parametrize('verify_length', ['fixed', 'auto'])
def test_suffix_decoding_is_lossless(tiny_split, prompts, verify_length):
  """Fixed (every step host-proposed) and auto (host-proposed tiers and AR, priced so that
  speculation pays) equal AR; a repeat does not draft from its own earlier answer."""
  graphdef, params = tiny_split
  expected = _ar_ids(tiny_split, prompts)
  drafter = SuffixDrafter(num_draft=6, max_depth=16, max_spec_offset=2.0,
                          cache_id=f'test_lossless_{len(prompts)}_{verify_length}')
  engine = runner.speculative_engine(
      graphdef, drafter, verify_length=verify_length,
      controller=ControllerConfig(tiers=(0, 1, 3, 6)), cost_table=_paying(len(prompts), 6))
  accepted = []
  for _ in range(2):
    ids, state = generate(engine, params, None, prompts, _NEW)
    assert ids == expected and all(len(g) == _NEW for g in expected)
    accepted.append(np.asarray(state.stats.accepted_B).tolist())
  assert accepted[0] == accepted[1] and sum(accepted[0]) > 0
  if verify_length == 'auto':
    assert max(engine.tier_steps()) > 0   # host-proposed tiers ran


@pytest.mark.slow
def test_out_of_vocabulary_drafts_end_the_proposal(tiny_split):
  """A host proposal with ids outside the vocabulary (a buggy drafter) is cut at the first
  of them: the output stays AR's (an out-of-range embedding would be NaN in the cache)."""
  graphdef, params = tiny_split
  vocab = 64
  prompt_BP, lens = pad_prompts([[3, 4, 5, 6], [7, 8, 9]])
  ar = SpeculativeEngine(graphdef)
  expected = generated_ids(ar.generate(params, None, ar.prefill(params, None, prompt_BP,
                                                                lens, max_new_tokens=12)))
  engine = SpeculativeEngine(graphdef, drafter=SuffixDrafter(num_draft=4))
  state = engine.prefill(params, None, prompt_BP, lens, max_new_tokens=12)
  # Row 0 drafts AR's next token, then ids past the vocabulary; row 1 a negative id first.
  tokens_BG = np.array([[expected[0][1], vocab, vocab + 7, 2], [-3, 1, 2, 3]], np.int32)
  state = engine.step(params, None, state,
                      Proposal(tokens_BG, np.array([4, 4], np.int32)))
  assert np.asarray(state.stats.proposed_B).tolist() == [1, 0]
  assert np.asarray(state.stats.accepted_B).tolist() == [1, 0]
  state = engine.generate(params, None, state)
  assert generated_ids(state) == expected


class _SilentHostDrafter:
  """Proposes nothing, and counts how often it was asked."""

  num_draft = 4

  def __init__(self):
    self.calls = 0

  def start(self, sequences):
    self.sequences = [list(s) for s in sequences]
    self.longest = [list(s) for s in sequences]

  def propose(self, sequences, live):
    self.calls += 1
    # Every row's tokens only grow (judging in retrospect passes prefixes of them).
    for b, seq in enumerate(sequences):
      short, long = sorted((seq, self.longest[b]), key=len)
      assert long[:len(short)] == short
      self.longest[b] = list(long)
    return np.zeros((len(sequences), 4), np.int32), np.zeros((len(sequences),), np.int32)

  def finish(self, sequences):
    pass



def test_walks_judge_at_most_their_last_lengths():
  """A host judge proposes only at the last `width` lengths of each row (the verdict is
  about now; the host shares the CPU with the device), one sample per walk step."""
  host = _SilentHostDrafter()
  session = HostSession(host, np.array([list(range(20)), list(range(12)) + [0] * 8]),
                        np.array([20, 12]))
  accepted, judged, proposed = session.judge([1, 10], width=5)
  assert host.calls == 5
  assert (judged > 0).sum(axis=1).tolist() == [5, 2] and not proposed.any()
  assert accepted.sum() == 0


class _HostDrafterFrom(_SilentHostDrafter):
  """Drafts 4 tokens: AR's own continuation from generated token `right_from` until
  `right_until`, the wrong ones (AR's token + 1) elsewhere."""

  def __init__(self, expected, right_from, right_until=99):
    super().__init__()
    self.expected, self.right = expected, range(right_from, right_until)

  def propose(self, sequences, live):
    self.calls += 1
    tokens = np.zeros((len(sequences), 4), np.int32)
    for b, seq in enumerate(sequences):
      done = len(seq) - len(self.sequences[b])   # generated tokens (the prompt: < 0)
      ahead = list(self.expected[b][done:done + 4]) if done >= 0 else []
      if live[b] and ahead:
        tokens[b, :len(ahead)] = ahead if done in self.right else [t + 1 for t in ahead]
    return tokens, np.array([4 * bool(t.any()) for t in tokens], np.int32) * live


class _ShorteningHostDrafter(_HostDrafterFrom):
  """AR's own continuation, proposing 1, 2, 3, 1, 2, 3, … of its 4 drafts per step."""

  def __init__(self, expected):
    super().__init__(expected, right_from=0)

  def propose(self, sequences, live):
    tokens, num = super().propose(sequences, live)
    return tokens, np.minimum(num, 1 + (self.calls - 1) % 3)


class _RecordingSteps:
  """A chain engine's `step`, recording each one's (verify width, longest proposal)."""

  def __init__(self, engine):
    self.engine, self.widths = engine, []

  def warm_marks(self, tokens_shape):
    return self.engine.warm_marks(tokens_shape)

  def step(self, params, dparams, state, proposal):
    self.widths.append((proposal.tokens_BG.shape[1],
                        int(np.max(jax.device_get(proposal.num_proposed_B)))))
    return self.engine.step(params, dparams, state, proposal)



def test_the_host_judge_walks_as_verify_steps_would():
  """Right drafts from token 2 to 9: the walk over them takes 4 drafts a step there (each
  sample: drafts matched, comparable positions, proposed), 0 elsewhere, as
  `estimate.retrospective_match` does on the device."""
  expected = [list(range(100, 130))]
  host = _HostDrafterFrom(expected, right_from=2, right_until=10)
  session = HostSession(host, np.array([[1]]), np.array([1]))
  host.sequences = [[1]]
  session.sequences[0] += expected[0][:16]
  accepted, judged, proposed = session.judge([1], width=16)
  n = int((judged[0] > 0).sum())
  assert accepted[0, :n].tolist() == [0, 0, 4, 4, 0, 0, 0, 0]
  assert judged[0, :n].tolist() == [4, 4, 4, 4, 4, 3, 2, 1] and proposed[0, :n].all()


@pytest.mark.slow
def test_silent_and_rejected_host_drafters_run_as_ar(tiny_split):
  """Under auto, a host drafter that proposes nothing, or only wrong drafts, costs AR's
  steps: the controller judges it on the prompt and after each chunk, finds nothing to
  take, and stays at tier 0; the output is AR's."""
  expected = _ar_ids(tiny_split)
  for make in (lambda: _SilentHostDrafter(),
               lambda: _HostDrafterFrom(expected, right_from=99)):
    engine = runner.speculative_engine(
        tiny_split[0], SuffixDrafter(num_draft=4), controller=ControllerConfig(tiers=(0, 4)),
        cost_table=_paying(2, 4, per_token=0.5))
    engine.host.use_factory(make)
    ids, state = generate(engine, tiny_split[1], None, _PROMPTS, _NEW)
    assert ids == expected and set(engine.tier_steps()) == {0}
    assert int(np.asarray(state.stats.proposed_B).sum()) == 0


@pytest.mark.slow
def test_auto_speculates_where_the_host_drafter_would_pay(tiny_split):
  """Right drafts from generated token 8 on: the controller starts at AR (the prompt's
  walk takes nothing), judges the chunk in retrospect, and moves to the host-proposed tier,
  whose steps accept drafts; the output is AR's."""
  expected = _ar_ids(tiny_split)
  engine = runner.speculative_engine(
      tiny_split[0], SuffixDrafter(num_draft=4),
      controller=ControllerConfig(tiers=(0, 4), steps_per_decision=4),
      cost_table=_paying(2, 4, per_token=0.1))
  engine.host.use_factory(lambda: _HostDrafterFrom(expected, right_from=8))
  ids, state = generate(engine, tiny_split[1], None, _PROMPTS, _NEW)
  assert ids == expected
  assert engine.last_trace[0][0] == 0 and engine.tier_steps().get(4, 0) > 0
  assert int(np.asarray(state.stats.accepted_B).min()) > 0


@pytest.mark.slow
def test_steps_verify_the_width_their_longest_proposal_needs(tiny_split):
  """Proposals of 1, 2, 3, 1, ... drafts verify at widths 1, 2, 4 (the next power of two):
  a short proposal does not pay for the drafter's full width; every width is compiled
  before the generation (`HostEngine.warm`), which then compiles nothing."""
  expected = _ar_ids(tiny_split)
  engine = runner.speculative_engine(tiny_split[0], SuffixDrafter(num_draft=4),
                                     verify_length='fixed')
  engine.use_factory(lambda: _ShorteningHostDrafter(expected))
  prompt_BP, lens = pad_prompts(_PROMPTS)
  state = engine.prefill(tiny_split[1], None, prompt_BP, lens, max_new_tokens=_NEW)
  engine.warm(tiny_split[1], None, state)
  engine.engine = recorder = _RecordingSteps(engine.engine)
  with compiled_programs.counting_compiles() as compiles:
    state = engine.generate(tiny_split[1], None, state)
  assert generated_ids(state) == expected and not compiles
  assert recorder.widths[:3] == [(1, 1), (2, 2), (4, 3)]
  assert all(w == verify_width(n, 4) for w, n in recorder.widths)
