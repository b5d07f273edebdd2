"""Tests for dspec/decoding/drafters/suffix.py: trie counts, speculation, caches, lossless."""

import random
import time

import jax
import numpy as np
import pytest

from dspec.decoding.drafters.suffix import (SharedSuffixCache, SuffixCache, SuffixDrafter,
                                            SuffixTree, speculate)
from dspec.decoding import host_loop
from dspec.decoding.prompts import pad_prompts
from dspec.decoding.engine import SpeculativeEngine, _programs
from dspec.decoding.host_loop import (ARFallback, Walk, _committed_since, _try_then_run,
                                      _unpaid_after, compile_step_widths,
                                      generate_host_loop, judge_in_retrospect,
                                      verify_width)
from dspec.decoding.prompts import generated_ids, row_tokens
from dspec.decoding.state import Proposal
from dspec.sampling import SamplingSpec


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


@pytest.mark.slow
@pytest.mark.parametrize('prompts', [
    [[3, 4, 5, 6] * 5],
    [[3, 4, 5, 6] * 5, [7, 8, 9] * 3 + [10, 11]],
], ids=['batch1', 'batch2'])
def test_suffix_decoding_is_lossless(tiny_split, prompts):
  graphdef, params = tiny_split
  max_new = 40
  prompt_BP, lens = pad_prompts(prompts)
  ar = SpeculativeEngine(graphdef)
  state = ar.prefill(params, None, prompt_BP, lens, max_new_tokens=max_new)
  expected = generated_ids(ar.generate(params, None, state))

  drafter = SuffixDrafter(num_draft=6, max_depth=16, max_spec_offset=2.0,
                          cache_id=f'test_lossless_{len(prompts)}')
  engine = SpeculativeEngine(graphdef, drafter=drafter)
  accepted = []
  for _ in range(2):   # a repeat must not draft from its own earlier answer
    state = engine.prefill(params, None, prompt_BP, lens, max_new_tokens=max_new)
    state = generate_host_loop(engine, params, None, state, drafter.host_drafter_factory()())
    assert generated_ids(state) == expected
    assert all(len(g) == max_new for g in expected)
    accepted.append(np.asarray(state.stats.accepted_B).tolist())
  assert accepted[0] == accepted[1]
  assert sum(accepted[0]) > 0


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


def test_walks_judge_at_most_their_last_tokens():
  """A walk with a tail proposes only at the last `tail` lengths: the verdict is about now,
  and the host's work shares the CPU with the device's."""
  host = _SilentHostDrafter()
  sequences = [list(range(20)), list(range(12))]
  host.start(sequences)
  walk = judge_in_retrospect(host, sequences, [1, 10], tail=5)
  assert host.calls == 5 and walk.steps_B.tolist() == [5, 2]
  assert walk.tokens_B.tolist() == [5, 2] and not walk.took_drafts()


def test_a_walk_earns_a_try_only_when_its_last_step_took_a_draft():
  """Too few drafts to pay at a step's price: a try when the walk ended taking a draft (a
  paying stretch may be starting there), none for drafts taken earlier (at T > 0, walks
  take scattered ones); enough to pay: speculate."""
  early = Walk(np.array([5, 4]), np.array([7, 4]), np.array([1, 1]))
  late = Walk(np.array([5, 4]), np.array([7, 4]), np.array([1, 3]))
  assert _unpaid_after(early, 100.0, patience=2) == 2
  assert _unpaid_after(late, 100.0, patience=2) == 1
  assert _unpaid_after(early, 1.2, patience=2) == 0


class _CountingSteps:
  """Forwards `step` to an engine, counting the speculative steps (alone or a
  `try_then_run`'s) and recording each one's (verify width, longest proposal)."""

  def __init__(self, engine):
    self.engine, self.num_draft, self.calls, self.widths = engine, engine.num_draft, 0, []

  def record(self, proposal):
    self.calls += 1
    self.widths.append((proposal.tokens_BG.shape[1], int(np.max(proposal.num_proposed_B))))

  def step(self, *args):
    self.record(args[3])
    return self.engine.step(*args)


class _CountingChunks(ARFallback):
  """An AR fallback counting its AR chunks (`run` calls, and `try_then_run` calls whose
  step was rejected and AR steps ran) and its `try_then_run` calls (`tries`)."""

  calls = tries = 0

  def run(self, *args):
    self.calls += 1
    return super().run(*args)

  def try_then_run(self, counted, target_params, drafter_params, state, proposal, max_steps):
    counted.record(proposal)
    self.tries += 1
    before = int(np.sum(state.stats.steps_B)) + int(np.sum(~state.done_B))
    state, paid = super().try_then_run(counted.engine, target_params, drafter_params, state,
                                       proposal, max_steps)
    self.calls += int(np.sum(state.stats.steps_B)) > before
    return state, paid


# Sampled at T = 1 from the top 1: AR's greedy output, through the loop's T > 0 paths.
_ARGMAX_SAMPLED = SamplingSpec(greedy=False, top_k=1)


def _host_loop_with_fallback(tiny_split, make_host, step_cost=1.5, prompts=None,
                             judge_prompts=True, widths=None, fallbacks=None, reuse=None,
                             sampling=SamplingSpec()):
  """(final state, host drafter, speculative steps, AR chunks) of the host loop with an AR
  fallback (patience 2, chunks from 4, a speculative step priced at `step_cost` AR steps),
  60 new tokens, checked equal to AR's; `make_host(ar_ids)` builds the drafter. Without
  `judge_prompts` the drafter starts on the prompts and the prefill's token unjudged, so
  the loop starts speculating. `widths` (a list) gets each step's (verify width, longest
  proposal); `fallbacks` (a list) the AR fallback (`_CountingChunks`), or `reuse` it (its
  counts go on from there). `sampling`: the engines' (greedy; `_ARGMAX_SAMPLED`: at T = 1)."""
  graphdef, params = tiny_split
  prompt_BP, lens = pad_prompts(prompts or [[3, 4, 5, 6], [7, 8, 9]])
  ar = SpeculativeEngine(graphdef)
  expected = generated_ids(ar.generate(params, None, ar.prefill(params, None, prompt_BP,
                                                                lens, max_new_tokens=60)))
  engine = SpeculativeEngine(graphdef, drafter=SuffixDrafter(num_draft=4), sampling=sampling)
  fallback = reuse or _CountingChunks.of(engine)
  host = make_host(expected)
  state = engine.prefill(params, None, prompt_BP, lens, max_new_tokens=60,
                         temperature=0.0 if sampling.greedy else 1.0)
  if not judge_prompts:
    host.start(row_tokens(*jax.device_get((state.tokens_BL, state.num_tokens_B))))
  counted = _CountingSteps(engine)
  state = generate_host_loop(counted, params, None, state, host, fallback=fallback,
                             patience=2, chunk=4, step_cost=step_cost,
                             started=not judge_prompts)
  assert generated_ids(state) == expected
  if widths is not None:
    widths.extend(counted.widths)
  if fallbacks is not None:
    fallbacks.append(fallback)
  return state, host, counted.calls, fallback.calls


@pytest.mark.slow
def test_host_loop_judges_the_prompt_before_the_first_step(tiny_split):
  """A drafter that proposes nothing: AR chunks from the start (4 + 16 + 39 tokens: they
  grow 4× while judged walks take nothing), not a step. Suffix decoding on prompts that
  repeat: their walk beats a step priced at 1.5 AR steps, so the loop speculates at once
  (on this target's output it proposes nothing, which would not pay for a verify: an AR
  step, then no try, and AR chunks); priced at 100 AR steps, the walk took drafts, but too
  few, and a prompt earns no try step (a chunk walk would): AR chunks only."""
  _, _, steps, chunks = _host_loop_with_fallback(tiny_split, lambda _: _SilentHostDrafter())
  assert (steps, chunks) == (0, 3)
  suffix = lambda _: SuffixDrafter(num_draft=4).host_drafter_factory(private=True)()
  repeating = [[3, 4, 5, 6] * 5, [7, 8, 9] * 6]
  _, _, steps, chunks = _host_loop_with_fallback(tiny_split, suffix, prompts=repeating)
  assert (steps, chunks) == (0, 1 + 3)
  _, _, steps, chunks = _host_loop_with_fallback(tiny_split, suffix, 100.0, prompts=repeating)
  assert (steps, chunks) == (0, 3)


@pytest.mark.slow
def test_a_prompt_earns_speculation_at_the_rate_earlier_prompts_realised(tiny_split):
  """The repeating prompts' walk earns speculation (an AR step, as above); their stretch
  realised 1 token per step against the walk's prediction, and the fallback keeps that:
  the same prompts then earn none (AR chunks only), and the output is still AR's."""
  suffix = lambda _: SuffixDrafter(num_draft=4).host_drafter_factory(private=True)()
  repeating = [[3, 4, 5, 6] * 5, [7, 8, 9] * 6]
  fallbacks = []
  _, _, steps, chunks = _host_loop_with_fallback(tiny_split, suffix, 2.0, prompts=repeating,
                                                 fallbacks=fallbacks)
  assert (steps, chunks) == (0, 1 + 3)
  fallback = fallbacks[0]
  # 2 row-steps committed 2 tokens, where the walk predicted over 2 (the step's price).
  assert 0.5 < fallback.prompt_realised < 0.75
  fallback.calls = 0
  _, _, steps, chunks = _host_loop_with_fallback(tiny_split, suffix, 2.0, prompts=repeating,
                                                 reuse=fallback)
  assert (steps, chunks) == (0, 3)


@pytest.mark.slow
def test_steps_verify_the_width_their_longest_proposal_needs(tiny_split):
  """Each step verifies the next power of two at or above its longest proposal (at most
  num_draft 4): proposals of 1, 2, 3 drafts take steps of widths 1, 2, 4; the output is
  AR's and every draft is accepted. A proposal that could not pay for its step even if
  accepted whole is not verified."""
  assert [verify_width(n, 16) for n in range(18)] == [1, 1, 2] + [4] * 2 + [8] * 4 + [16] * 9
  assert verify_width(5, 6) == 6
  widths = []
  state, _, steps, _ = _host_loop_with_fallback(
      tiny_split, lambda ar_ids: _ShorteningHostDrafter([e[1:] for e in ar_ids]),
      judge_prompts=False, widths=widths)
  assert widths[:6] == [(1, 1), (2, 2), (4, 3)] * 2
  assert all(w == verify_width(n, 4) for w, n in widths), widths
  stats = jax.device_get(state.stats)
  assert np.array_equal(stats.accepted_B, stats.proposed_B) and steps == len(widths)
  # Priced at 2 AR steps, a 1-draft proposal could not pay for a verify: an AR step instead.
  widths = []
  _host_loop_with_fallback(
      tiny_split, lambda ar_ids: _ShorteningHostDrafter([e[1:] for e in ar_ids]), 2.0,
      judge_prompts=False, widths=widths)
  assert widths[:4] == [(2, 2), (4, 3)] * 2 and (1, 1) not in widths


def _first_and_later_ms(run, later: int = 5):
  """Wall ms of `run()`'s first call and the median of the `later` calls after it."""
  times = []
  for _ in range(1 + later):
    t = time.perf_counter()
    jax.block_until_ready(run())
    times.append(1e3 * (time.perf_counter() - t))
  return times[0], float(np.median(times[1:]))


@pytest.mark.slow
def test_every_verify_width_compiles_before_the_loop(tiny_split):
  """`compile_step_widths` (the runner's, before the timer starts) compiles the step, and
  the step carrying an AR chunk along, at widths 1, 2 and 4 of num_draft 4, and the
  read-back: the loop, stepping at all three and running AR chunks, compiles nothing (a
  compile would land in the loop's step timings, which price the next generations). Nor
  does a first run, or its warm-up runs still on the device: XLA:CPU's first run of a
  verify or AR loop cost ~8× a later one here (~10 ms), until `compile_step_widths` ran
  each with drafts and an AR step and waited for them. A fresh fallback then prices a step
  against AR's once (`ARFallback.price`)."""
  graphdef, params = tiny_split
  prompt_BP, lens = pad_prompts([[3, 4, 5, 6], [7, 8, 9]])
  ar = SpeculativeEngine(graphdef)
  expected = generated_ids(ar.generate(params, None, ar.prefill(params, None, prompt_BP,
                                                                lens, max_new_tokens=24)))
  engine = SpeculativeEngine(graphdef, drafter=SuffixDrafter(num_draft=4,
                                                             cache_id='test_widths'))
  fallback = ARFallback.of(engine)
  state = engine.prefill(params, None, prompt_BP, lens, max_new_tokens=24)
  copies = [jax.tree.map(lambda x: x.copy(), state) for _ in range(6 * 4 + 2)]
  jax.block_until_ready(copies)
  compile_step_widths(engine, params, None, state, fallback)
  programs = (_programs(engine, state.tokens_BL.shape)['step'],
              _try_then_run(engine, fallback.engine),
              _committed_since)
  compiled = [p._cache_size() for p in programs]
  for width in (1, 2, 4):
    drafts = jax.device_put(Proposal(np.ones((2, width), np.int32), np.full((2,), width,
                                                                            np.int32)))
    first, later = _first_and_later_ms(lambda: engine.step(params, None, copies.pop(), drafts))
    assert first < 3 * later + 2, (width, first, later)
  first, later = _first_and_later_ms(lambda: fallback.run(params, None, copies.pop(), 4))
  assert first < 3 * later + 2, (first, later)
  host = _ShorteningHostDrafter([e[1:] for e in expected])
  host.start(row_tokens(*jax.device_get((state.tokens_BL, state.num_tokens_B))))
  state = generate_host_loop(engine, params, None, state, host, fallback=fallback,
                             started=True)
  assert generated_ids(state) == expected
  assert compiled[:2] == [3, 3] and [p._cache_size() for p in programs] == compiled
  # A fresh fallback prices a step against AR's before its first generation, once.
  fresh = ARFallback.of(engine)
  for _ in range(2):
    fresh.price(engine, params, None, copies.pop())
    assert len(fresh.step_s) == len(fresh.ar_token_s) == 1 and fresh.step_cost() > 1


@pytest.mark.slow
def test_quiet_ar_chunks_queue_behind_each_other(tiny_split, monkeypatch):
  """A drafter that proposes nothing, prompts judged: AR chunks of 4, 16, 39, each queued
  before the one before it is read back (the device never waits on the host between
  them); the last, which ends the generation, is read back at once."""
  events = []
  take, run = host_loop._take_read_back, _CountingChunks.run
  monkeypatch.setattr(host_loop, '_take_read_back',
                      lambda *a: (events.append('take'), take(*a))[1])
  monkeypatch.setattr(_CountingChunks, 'run',
                      lambda self, *a: (events.append('run'), run(self, *a))[1])
  _host_loop_with_fallback(tiny_split, lambda _: _SilentHostDrafter())
  assert events == ['run', 'run', 'take', 'run', 'take', 'take']


@pytest.mark.slow
def test_host_loop_falls_back_to_ar_chunks_when_the_drafter_is_silent(tiny_split):
  _, _, steps, chunks = _host_loop_with_fallback(tiny_split, lambda _: _SilentHostDrafter(),
                                                 judge_prompts=False)
  # Empty proposals would not pay for a verify: an AR step (unpaid), no try, then AR
  # chunks of 4, 16, 38 tokens (58 to go); never a verify step.
  assert (steps, chunks) == (0, 1 + 3)


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
      done = len(seq) - len(self.sequences[b])
      ahead = list(self.expected[b][done:done + 4])
      if live[b] and ahead:
        tokens[b, :len(ahead)] = ahead if done in self.right else [t + 1 for t in ahead]
    return tokens, np.full((len(sequences),), 4, np.int32) * live


class _ShorteningHostDrafter(_HostDrafterFrom):
  """AR's own continuation, proposing 1, 2, 3, 1, 2, 3, … of its 4 drafts per step."""

  def __init__(self, expected):
    super().__init__(expected, right_from=0)

  def propose(self, sequences, live):
    tokens, num = super().propose(sequences, live)
    return tokens, np.minimum(num, 1 + (self.calls - 1) % 3)


class _SparselyRightHostDrafter(_HostDrafterFrom):
  """Drafts 4 wrong tokens, but AR's next token first at every third position (from
  `first` on): walks take a draft now and then (never quiet), too few to pay."""

  def __init__(self, expected, first=0):
    super().__init__(expected, right_from=99)
    self.first = first

  def propose(self, sequences, live):
    tokens, num = super().propose(sequences, live)
    for b, seq in enumerate(sequences):
      done = len(seq) - len(self.sequences[b])
      if live[b] and done % 3 == 0 and self.first <= done < len(self.expected[b]):
        tokens[b, 0] = self.expected[b][done]
    return tokens, num


@pytest.mark.slow
def test_chunks_grow_as_if_quiet_once_recent_judges_earned_nothing(tiny_split):
  """Walks that take a few drafts, priced at 100 AR steps (none pays), at T = 1: after
  the AR step of the stretch, the chunks grow 2× (4, 8, 16, 32), each judged at once; with
  a full window of barren judges in the fallback, they grow 4× and queue (4, 16, 64), as
  when walks take nothing. At T = 0 the window does not count: 2× and judged."""
  for sampling, barren, expected in ((_ARGMAX_SAMPLED, False, [1, 4, 8, 16, 32]),
                                     (_ARGMAX_SAMPLED, True, [1, 4, 16, 64]),
                                     (SamplingSpec(), True, [1, 4, 8, 16, 32])):
    lengths = []

    class Recording(_CountingChunks):
      def run(self, target_params, drafter_params, state, max_steps):
        lengths.append(max_steps)
        return super().run(target_params, drafter_params, state, max_steps)

    fallback = Recording.of(SpeculativeEngine(tiny_split[0], sampling=sampling,
                                              drafter=SuffixDrafter(num_draft=4)))
    fallback.judges_earned.extend([False] * barren * fallback.judges_earned.maxlen)
    assert fallback.judges_barren() == (barren and not sampling.greedy)
    _host_loop_with_fallback(tiny_split,
                             lambda ar_ids: _SparselyRightHostDrafter([e[1:] for e in ar_ids]),
                             100.0, judge_prompts=False, reuse=fallback, sampling=sampling)
    assert lengths == expected and not any(fallback.judges_earned)


@pytest.mark.slow
def test_steps_too_short_to_pay_end_a_stretch_and_barren_judges_earn_no_tries(tiny_split):
  """At T = 1 (sampled from the top 1), drafts right at every third position from 3,
  priced at 4.5 AR steps (a step with 4 drafts could pay; one accepting a single draft
  commits 2 tokens per row, and does not):
  two unpaid steps, then AR chunks. Each chunk walk whose last step took a draft earns a
  try, which accepts a draft but does not pay for itself: back to AR chunks (it used to
  start a stretch that ran to the end, a draft accepted every other step), the judge
  recorded as barren. 2 steps + 2 tries. With a full window of barren judges the same
  walks earn no try: the 2 steps, then AR chunks only."""
  make = lambda ar_ids: _SparselyRightHostDrafter([e[1:] for e in ar_ids], first=3)
  fallbacks = []
  _, _, steps, _ = _host_loop_with_fallback(tiny_split, make, 4.5, judge_prompts=False,
                                            fallbacks=fallbacks, sampling=_ARGMAX_SAMPLED)
  assert steps == 2 + 2 and list(fallbacks[0].judges_earned) == [False] * 3
  fallback = fallbacks[0]
  fallback.judges_earned.extend([False] * fallback.judges_earned.maxlen)
  fallback.calls = 0
  _, _, steps, _ = _host_loop_with_fallback(tiny_split, make, 4.5, judge_prompts=False,
                                            reuse=fallback, sampling=_ARGMAX_SAMPLED)
  assert steps == 2 and not any(fallback.judges_earned)


@pytest.mark.slow
def test_host_loop_falls_back_when_drafts_are_rejected(tiny_split):
  """Proposals that never pay count like empty ones, and judged in retrospect after each
  AR chunk they never win speculation back."""
  # The host copy starts after the prefill's token; drafts target the tokens after it.
  fallbacks = []
  state, host, steps, chunks = _host_loop_with_fallback(
      tiny_split, lambda ar_ids: _HostDrafterFrom([e[1:] for e in ar_ids], right_from=99),
      judge_prompts=False, fallbacks=fallbacks)
  assert int(np.asarray(state.stats.accepted_B).sum()) == 0
  # The second unpaid step carries the first AR chunk along (one device call for both);
  # that chunk's AR tokens are timed too (the call's time less a step's), as the others.
  fallback, = fallbacks
  assert (steps, chunks, fallback.tries) == (2, 3, 1)
  assert (len(fallback.step_s), len(fallback.ar_token_s)) == (1, 3)
  # Asked for two steps, then judged on the host at every length the AR chunk of 4
  # committed (right away); the chunk of 16 is quiet, judged while the next one runs, but
  # that one (37 tokens) ends the generation, where no verdict could act: not judged.
  assert host.calls == 2 + 4


@pytest.mark.slow
def test_host_loop_resumes_speculation_when_it_would_have_paid(tiny_split):
  """Right drafts from token 2 to 29, wrong ones elsewhere: two unpaid steps (tokens 0,
  1); an AR chunk of 4 (2-5, judged: 4 tokens in 1 step, over the step's price of 2);
  five steps (6-30), two unpaid ones (31, 32) and AR chunks again from 4: 4 (judged:
  nothing taken), 16, 6. Priced at 4.5 AR steps (a step with 4 drafts could still pay),
  the walk over the 4 earns one step instead, which pays, and the chunks go on growing from
  there: 8, 18. Each second unpaid
  step, and the walk's step, carries its AR chunk along in one device call; run only
  where the step was rejected. The fallback records each chunk judge's outcome: the first
  earned a step that paid, the last earned none."""
  make = lambda ar_ids: _HostDrafterFrom([e[1:] for e in ar_ids], 2, 30)
  for step_cost, expected_chunks, expected_tries in ((2.0, 4, 2), (4.5, 3, 3)):
    fallbacks = []
    state, _, steps, chunks = _host_loop_with_fallback(tiny_split, make, step_cost,
                                                       judge_prompts=False,
                                                       fallbacks=fallbacks)
    assert chunks == expected_chunks and fallbacks[0].tries == expected_tries
    # The judge over the first chunk earned a step that paid; the last judge, none.
    assert list(fallbacks[0].judges_earned) == [True, False]
    assert steps == 2 + 5 + 2 and int(np.asarray(state.stats.accepted_B).min()) > 0
