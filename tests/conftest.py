"""Shared tiny models: built once per session so jitted programs are reused across tests."""

import atexit
import os
import shutil
import sys
import tempfile

# The scripts the tests start share one compile cache (and controller cost tables) per test
# run, never the user's: a run starts as cold as CI's, and programs one script compiled load
# in the next. Set before dspec is imported (its default cache folder reads XDG_CACHE_HOME);
# xdist workers and scripts inherit the variable. The test processes themselves keep the
# cache off, so each controller there profiles its own cost table.
if 'DSPEC_TEST_CACHE_HOME' not in os.environ:
  os.environ['DSPEC_TEST_CACHE_HOME'] = tempfile.mkdtemp(prefix='dspec-test-cache-')
  atexit.register(shutil.rmtree, os.environ['DSPEC_TEST_CACHE_HOME'], ignore_errors=True)
os.environ['XDG_CACHE_HOME'] = os.environ['DSPEC_TEST_CACHE_HOME']
# Compiling dominates the suite: the test processes and the scripts they start compile with
# XLA's fast-compile flags (tests/xla_flags.py). Set before jax starts.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xla_flags import with_fast_compile  # noqa: E402
os.environ['XLA_FLAGS'] = with_fast_compile(os.environ.get('XLA_FLAGS', ''))

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)   # `configs` is a folder of the repo, not an installed package

from dspec import compiled_programs  # noqa: E402
from dspec.decoding.prompts import generated_ids, pad_prompts  # noqa: E402
from dspec.models.config import TransformerConfig  # noqa: E402
from dspec.models.transformer import Transformer  # noqa: E402


# The quick check, `pytest -m 'not slow and not multiprocess'`, runs the tests outside both
# markers in about 2 minutes on one core; `pytest -q` (CI) runs them all. Each test module
# keeps at least one test outside both, a cheap one, even where that one is slow or starts a
# process (tests/test_markers.py checks it).
MARKERS = {
    'slow': 'takes 3 s or more on one CPU core, its fixtures included (compiles, trains, '
            'decodes with every drafter)',
    'multiprocess': 'starts other Python processes that do real work: multi-process runs, mesh '
                    'checks in subprocesses, scripts run as a user runs them',
}
# How many tests of each collected module are outside both markers (tests/test_markers.py).
QUICK_TESTS_BY_MODULE = pytest.StashKey[dict]()


def pytest_configure(config):
  for name, meaning in MARKERS.items():
    config.addinivalue_line('markers', f'{name}: {meaning}')


# The files whose fixtures run several processes for minutes, longest first.
LONGEST_FILES = ('scale/test_sharding.py', 'scale/test_multiprocess.py',
                 'scale/test_controller.py', 'test_cli.py', 'test_notebook.py')


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Before `-m` deselects anything: how many tests of each module the quick check keeps.
  Then the order: `LONGEST_FILES`, files with tests that start processes, files with slow
  tests, the rest; pytest.ini hands each xdist worker whole files (a module's fixtures are
  built once) in this order, so the long files start first and short ones fill the end."""
  counts = config.stash[QUICK_TESTS_BY_MODULE] = {}
  rank = {}
  for item in items:
    module = os.path.relpath(str(item.path), REPO_ROOT)
    marks = {m.name for m in item.iter_markers()}
    counts[module] = counts.get(module, 0) + (not marks & set(MARKERS))
    name = os.path.relpath(module, 'tests')
    own = (LONGEST_FILES.index(name) if name in LONGEST_FILES else
           len(LONGEST_FILES) + (0 if 'multiprocess' in marks else 1 if 'slow' in marks else 2))
    rank[item.path] = min(rank.get(item.path, own), own)
  items.sort(key=lambda item: rank[item.path])


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
  """Drops compiled programs between tests once the process holds many memory mappings
  (a whole-suite process would otherwise pass vm.max_map_count and crash in the compiler)."""
  yield
  compiled_programs.release_if_many_maps()


TINY = TransformerConfig(vocab_size=64, num_layers=2, embed_dim=32, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                         tie_embeddings=False)


@pytest.fixture(scope='session')
def tiny_model():
  """A random tiny target whose greedy outputs are not trivially constant."""
  model = Transformer(TINY, rngs=nnx.Rngs(0))
  # Scale the head up so argmax ties are impossible and outputs vary with context.
  model.lm_head[...] = model.lm_head[...] * 20.0
  return model


# A 12-token vocabulary: small enough to enumerate joint distributions exactly.
TINY_VOCAB = TransformerConfig(vocab_size=12, num_layers=2, embed_dim=32, num_heads=4,
                               num_kv_heads=2, head_dim=8, mlp_dim=64, qk_norm=True,
                               tie_embeddings=False)


@pytest.fixture(scope='session')
def small_vocab_model():
  """A tiny-vocabulary target with peaked but non-degenerate next-token distributions."""
  model = Transformer(TINY_VOCAB, rngs=nnx.Rngs(3))
  model.lm_head[...] = model.lm_head[...] * 8.0
  return model


@pytest.fixture(scope='session')
def tiny_split(tiny_model):
  return nnx.split(tiny_model)


def generate(engine, params, drafter_params, prompts, max_new_tokens, **kw):
  """Runs prefill + on-device loop under `jax.transfer_guard('disallow')` (no implicit
  transfer may hide in the decode path); returns (generated ids per row, final state)."""
  prompt_BP, lens = pad_prompts(prompts)
  with jax.transfer_guard('disallow'):
    state = engine.prefill(params, drafter_params, prompt_BP, lens,
                           max_new_tokens=max_new_tokens, **kw)
    state = engine.generate(params, drafter_params, state)
  return generated_ids(state), state


def greedy_rows(target, rows=48, prompt_len=10, new=20, seed=0):
  """(tokens, loss_mask) of the target's greedy continuations of random prompts: rows in
  the self-distilled data format, the continuation supervised."""
  tokens = np.zeros((rows, prompt_len + new), np.int32)
  tokens[:, :prompt_len] = np.random.default_rng(seed).integers(1, 64, (rows, prompt_len))
  step = jax.jit(lambda t, x, p: jnp.argmax(t(x).logits_BTV[:, p - 1], axis=-1))
  for p in range(prompt_len, prompt_len + new):
    tokens[:, p] = np.asarray(step(target, tokens, p))
  loss_mask = np.zeros_like(tokens, bool)
  loss_mask[:, prompt_len:] = True
  return tokens, loss_mask

