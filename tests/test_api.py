"""The Python API: load_target, load_drafter, generate (texts, ids, metrics, traces, errors)."""

import numpy as np
import pytest
from flax import nnx

import dspec
from configs import common
from dspec import checkpoint
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer

PROMPTS = ['abcabcabc', 'hello hello']


@pytest.fixture(scope='module')
def target(tmp_path_factory):
  """A tiny random target (byte vocabulary) saved as a dspec checkpoint, then loaded."""
  path = str(tmp_path_factory.mktemp('api') / 'target')
  cfg = TransformerConfig(**common.MODEL_PRESETS['tiny'])
  checkpoint.save_model(path, Transformer(cfg, rngs=nnx.Rngs(0)), kind='target',
                        config=cfg.to_dict())
  return dspec.load_target(path)


@pytest.fixture(scope='module')
def ar(target):
  return dspec.generate(target, PROMPTS, max_new_tokens=12)


@pytest.mark.slow
def test_generate_returns_texts_ids_and_metrics(target, ar):
  assert len(ar.texts) == len(ar.ids) == len(ar.per_prompt) == 2
  assert all(len(ids) == 12 for ids in ar.ids)
  assert ar.texts[0] == target.tokenizer.decode(ar.ids[0])
  assert ar.metrics['method'] == 'ar' and ar.metrics['tau'] == 1.0
  assert ar.metrics['new_tokens'] == 24 and ar.trace is None
  ids = [target.tokenizer.encode(p) for p in PROMPTS]
  assert dspec.generate(target, ids, max_new_tokens=12).ids == ar.ids


@pytest.mark.slow
@pytest.mark.parametrize('verify_length', ['fixed', 'auto'])
def test_a_drafter_gives_the_ar_output(target, ar, verify_length):
  drafter = dspec.load_drafter('ngram', target=target, num_draft=4)
  out = dspec.generate(target, PROMPTS, drafter=drafter, max_new_tokens=12,
                       compare_ar=True, verify_length=verify_length, trace=True)
  assert out.ids == ar.ids and out.metrics['lossless'] is True
  assert out.metrics['verify_length'] == verify_length
  steps = out.trace['steps']
  assert len(steps) == len(out.metrics['acceptance_lengths'])
  committed = [out.trace['first_token']] + [t for s in steps for t in s['committed']]
  assert committed == ar.ids[0]
  for s in steps:
    assert s['accepted'] <= len(s['proposed']) <= 4
    assert s['committed'][:s['accepted']] == s['proposed'][:s['accepted']]
  if verify_length == 'auto':
    assert all('tier' in s for s in steps)


@pytest.mark.slow
def test_tree_verification_gives_the_ar_output(target, ar):
  drafter = dspec.load_drafter('ngram', target=target, num_draft=4)
  out = dspec.generate(target, PROMPTS, drafter=drafter, max_new_tokens=12,
                       compare_ar=True, verify_length='tree')
  assert out.ids == ar.ids and out.metrics['lossless'] is True
  assert out.metrics['verify_length'] == 'tree'
  assert 1.0 <= out.metrics['nodes_verified_per_step'] <= 32.0   # tries of recent matches
  traced = dspec.generate(target, PROMPTS, drafter=drafter, max_new_tokens=12,
                          verify_length='tree', trace=True)
  assert traced.ids == ar.ids
  assert traced.trace['steps'] and all('tree' in s and 'accepted_path' in s
                                       for s in traced.trace['steps'])
  auto = dspec.generate(target, PROMPTS, drafter=drafter, max_new_tokens=12,
                        compare_ar=True, verify_length='auto_tree')   # node budget by cost
  assert auto.ids == ar.ids and auto.metrics['verify_length'] == 'auto_tree'
  assert auto.metrics['tier_steps'] and set(auto.metrics['tier_steps']) <= {0, 1, 3, 7, 15, 31}
  traced = dspec.generate(target, PROMPTS, drafter=drafter, max_new_tokens=12,
                          verify_length='auto_tree', trace=True)
  assert traced.ids == ar.ids and all('tier' in s and 'tree' in s
                                      for s in traced.trace['steps'])


@pytest.mark.slow
def test_numpy_ids_and_tuples_are_taken_as_they_are(target, ar):
  """Validation refuses coercion, not numpy integers or tuples (issue 39)."""
  ids = tuple(np.asarray(target.tokenizer.encode(p), np.int32) for p in PROMPTS)
  assert dspec.generate(target, ids, max_new_tokens=np.int64(12)).ids == ar.ids


def test_bad_arguments_name_the_problem(target):
  with pytest.raises(ValueError, match='out of range'):
    dspec.generate(target, [[1, 2, 999]])
  with pytest.raises(ValueError, match='top_p'):
    dspec.generate(target, PROMPTS, temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match='temperature'):
    dspec.generate(target, PROMPTS, temperature=-1.0)
  with pytest.raises(ValueError, match='temperature'):
    dspec.generate(target, PROMPTS, temperature=float('nan'))
  with pytest.raises(ValueError, match='non-empty'):
    dspec.generate(target, [])
  with pytest.raises(ValueError, match='empty prompt'):
    dspec.generate(target, [[]])
  with pytest.raises(ValueError, match='wrap a single prompt'):
    dspec.generate(target, 'abc')
  with pytest.raises(ValueError, match='token ids'):
    dspec.generate(target, [['a', 'b']])
  with pytest.raises(ValueError, match='unknown drafter'):
    dspec.load_drafter('eagle9', target=target)
  with pytest.raises(ValueError, match="no field 'draft_len'"):
    dspec.load_drafter('ngram', target=target, draft_len=4)
  with pytest.raises(ValueError, match='neither a dspec checkpoint'):
    dspec.load_target('/nonexistent/dir')
