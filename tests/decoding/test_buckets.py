"""Shape buckets: `dspec.generate` compiles per bucket of prompt width and token buffer,
not per prompt length or budget, with outputs unchanged; `dspec.warmup` compiles ahead."""

import time

import jax
import pytest
from flax import nnx

import dspec
from configs import common
from dspec import checkpoint
from dspec.compiled_programs import counting_compiles
from dspec.decoding.controller import VerifyLengthController
from dspec.decoding.drafter import NoDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import bucket_shapes, generated_ids, pad_prompts, shape_bucket
from dspec.metrics import acceptance_metrics
from dspec.models.config import TransformerConfig
from dspec.models.mtp import MTP, MTPConfig, save_mtp
from dspec.models.transformer import Transformer

ROWS = [[5, 6, 7], [3, 4, 5, 6] * 4 + [3], list(range(1, 41))]   # ragged: 3, 17, 40 tokens
NEW = 12
TINY = TransformerConfig(**common.MODEL_PRESETS['tiny'])


@pytest.fixture(scope='module')
def target(tmp_path_factory):
  """A tiny random target (byte vocabulary) saved as a dspec checkpoint, then loaded."""
  path = str(tmp_path_factory.mktemp('buckets') / 'target')
  checkpoint.save_model(path, Transformer(TINY, rngs=nnx.Rngs(0)), kind='target',
                        config=TINY.to_dict())
  return dspec.load_target(path)


@pytest.fixture(scope='module')
def drafters(target, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('buckets') / 'mtp')
  save_mtp(path, MTP(MTPConfig(num_depths=2), TINY, rngs=nnx.Rngs(1)))
  return {'ngram': dspec.load_drafter('ngram', target=target, num_draft=4),
          'mtp': dspec.load_drafter('mtp', path, target=target)}


def _exact(target, drafter=None):
  """(ids, stats) of ROWS decoded at their exact shapes: width 40, a 52-token buffer."""
  graphdef, params = target.split()
  engine = SpeculativeEngine(graphdef, drafter=drafter.drafter if drafter else NoDrafter(),
                             stop_ids=tuple(target.tokenizer.stop_ids))
  dparams = drafter.params if drafter else None
  prompt_BP, lens = pad_prompts(ROWS)
  state = engine.generate(params, dparams, engine.prefill(params, dparams, prompt_BP, lens,
                                                          max_new_tokens=NEW))
  return generated_ids(state), state.stats


@pytest.fixture(scope='module')
def exact_ar(target):
  return _exact(target)[0]


def test_buckets_are_powers_of_two_from_the_minimum_up_to_the_context():
  assert [shape_bucket(n, 4096) for n in (1, 64, 65, 128, 129, 3000)] == [
      64, 64, 128, 128, 256, 4096]
  assert shape_bucket(20, 32) == 32 and shape_bucket(90, 96) == 96
  assert shape_bucket(100, 96) == 100   # past the context: no bucket (callers refuse it)
  # A slot past the prompt width: a 40-token prompt takes 63 (a 64-token buffer at most).
  assert bucket_shapes(40, NEW, 4096) == (63, 64)
  assert bucket_shapes(63, 1, 4096) == (63, 64) and bucket_shapes(64, 1, 4096) == (127, 128)
  assert bucket_shapes(40, 100, 4096) == (63, 256)
  prompt_BP, lens = pad_prompts(ROWS, min_width=63)
  assert prompt_BP.shape == (3, 63) and lens.tolist() == [3, 17, 40]


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['ngram', 'mtp'])
@pytest.mark.parametrize('verify_length', ['fixed', 'tree'])
def test_bucketed_outputs_equal_the_exact_shapes(target, drafters, exact_ar, kind,
                                                 verify_length):
  """A ragged batch padded to its buckets (width 63, a 64-token buffer) gives AR's tokens at
  the exact shapes; n-gram, which drafts from tokens alone, also its exact-shape run's
  acceptance."""
  out = dspec.generate(target, ROWS, drafters[kind], max_new_tokens=NEW,
                       verify_length=verify_length)
  assert out.ids == exact_ar
  if kind == 'ngram' and verify_length == 'fixed':
    ids, stats = _exact(target, drafters[kind])
    exact = acceptance_metrics(stats)
    assert ids == exact_ar
    for name in ('tau', 'acceptance_rate', 'per_position_acceptance'):
      assert out.metrics[name] == exact[name], name


@pytest.mark.slow
def test_calls_compile_once_per_bucket(target):
  """Under the controller (auto), calls over many prompt lengths and budgets: a bucket's
  first call compiles (and profiles), later calls in it compile nothing, and a new bucket
  compiles at most what the first call did (the bound of `prompts.shape_bucket`)."""
  # A drafter of its own (no engine or profile of another test), and no program compiled
  # yet: the first call compiles all that its bucket needs.
  drafter = dspec.load_drafter('ngram', target=target, num_draft=3, max_n=3)
  jax.clear_caches()
  calls = [(3, 12), (9, 12), (20, 30), (41, 20), (60, 4),   # width 63, buffer 64
           (70, 12), (90, 30), (100, 28)]                   # 127, 128
  counts = []
  for length, new in calls:
    with counting_compiles() as compiled:
      out = dspec.generate(target, [list(range(1, length + 1))], drafter,
                           max_new_tokens=new)
    assert len(out.ids[0]) <= new
    counts.append(len(compiled))
  assert counts[0] > 0 and counts[1:5] == [0] * 4, counts
  assert 0 < counts[5] <= counts[0] and counts[6:] == [0, 0], counts


@pytest.mark.slow
def test_after_warmup_its_buckets_compile_and_profile_nothing(target, capsys, monkeypatch):
  drafter = dspec.load_drafter('ngram', target=target, num_draft=5, max_n=3)   # its own
  assert dspec.warmup(target, drafter, prompt_lengths=[100], max_new_tokens=20) == [
      (127, 128)]
  assert 'dspec.warmup: 1 shape buckets (prompt width/token buffer: 127/128)' in (
      capsys.readouterr().err)
  monkeypatch.setattr(VerifyLengthController, 'profile',
                      lambda *a: pytest.fail('profiled again'))
  with counting_compiles() as compiled:
    out = dspec.generate(target, [list(range(1, 81))], drafter, max_new_tokens=40)
  assert compiled == [] and 0 < len(out.ids[0]) <= 40


@pytest.mark.slow
def test_warmup_checks_its_arguments(target):
  with pytest.raises(ValueError, match='prompt_lengths must be a non-empty list'):
    dspec.warmup(target, prompt_lengths=5)
  with pytest.raises(ValueError, match=r'prompt_lengths\[1\] must be in \[1, 4032\]'):
    dspec.warmup(target, prompt_lengths=[8, 4090])
  with pytest.raises(ValueError, match='batch_size'):
    dspec.warmup(target, batch_size=0)
  with pytest.raises(ValueError, match='verify_length'):
    dspec.warmup(target, verify_length='sometimes')


@pytest.fixture(scope='module')
def demo_target():
  return dspec.load_target('demo/target')


DEMO_ROWS = ['def fibonacci(n):', 'Question: A farmer has 12 cows and buys 7 more. Then half '
             'of them are sold. How many cows are left?\nAnswer:', 'import numpy as np\n']


@pytest.mark.slow
@pytest.mark.parametrize('kind,verify_length', [
    ('suffix', 'fixed'), ('eagle3', 'fixed'), ('dflash2', 'fixed'), ('dspark', 'fixed'),
    ('dflash', 'tree')])
def test_every_drafter_decodes_a_padded_ragged_batch_as_ar_does(demo_target, kind,
                                                                  verify_length):
  """The demo drafters on a ragged batch padded to its buckets write the exact-shape AR
  tokens (n-gram and MTP: `test_bucketed_outputs_equal_the_exact_shapes`)."""
  rows = [demo_target.tokenizer.encode(p) for p in DEMO_ROWS]
  exact = _exact_rows(demo_target, rows)
  path = {'dflash2': 'demo/dflash2'}.get(kind, f'demo/{kind}')
  drafter = (dspec.load_drafter(kind, target=demo_target) if kind == 'suffix' else
             dspec.load_drafter('dflash' if kind == 'dflash2' else kind, path,
                                target=demo_target))
  out = dspec.generate(demo_target, rows, drafter, max_new_tokens=NEW,
                       verify_length=verify_length)
  assert out.ids == exact


def _exact_rows(target, rows):
  graphdef, params = target.split()
  engine = SpeculativeEngine(graphdef, stop_ids=tuple(target.tokenizer.stop_ids))
  prompt_BP, lens = pad_prompts(rows)
  return generated_ids(engine.generate(params, None, engine.prefill(
      params, None, prompt_BP, lens, max_new_tokens=NEW)))


@pytest.mark.slow
def test_a_hundred_calls_stay_compiled_flat_and_fast(target, drafters):
  """What a notebook does (issue 59): a learned drafter under the default `auto`, warmed up
  once, then 100 `generate` calls over 100 distinct prompt lengths (up to the largest
  bucket) and three budgets. The calls compile nothing (the bound: what the warm-up
  compiled), memory mappings and RSS stay within 10% of the warm-up's, and each call takes
  at most 1.5x its own prefill + decode time (no compile or profile inside it)."""
  from dspec.compiled_programs import memory_map_count

  def rss_mb():
    with open('/proc/self/status') as f:
      return next(int(line.split()[1]) for line in f if line.startswith('VmRSS:')) / 1024

  drafter = drafters['mtp']
  lengths, budgets = list(range(2, 102)), (4, 8, 12)
  with counting_compiles() as warmup_compiles:
    for budget in budgets:
      dspec.warmup(target, drafter, prompt_lengths=lengths, max_new_tokens=budget)
  maps, rss = memory_map_count(), rss_mb()
  slow = []
  with counting_compiles() as call_compiles:
    for i, length in enumerate(lengths):
      t0 = time.perf_counter()
      out = dspec.generate(target, [[1 + (7 * j) % 200 for j in range(length)]], drafter,
                           max_new_tokens=budgets[i % 3])
      wall = time.perf_counter() - t0
      own = out.metrics['decode_s'] + out.metrics['ttft_s']
      if wall > 1.5 * own:
        slow.append((length, round(wall, 4), round(own, 4)))
  assert warmup_compiles and call_compiles == [], call_compiles
  assert abs(memory_map_count() - maps) <= 0.1 * maps and abs(rss_mb() - rss) <= 0.1 * rss
  assert not slow, slow
