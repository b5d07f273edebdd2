"""Cost of sampled verification (temperature, top-k, top-p) against greedy verification.

  python scripts/bench_sampling.py [--batch_sizes=1,16] [--rows=16] [--repeats=9]

For verify rows [B, rows, vocab] of the demo target shape (configs/common.py
MODEL_PRESETS['demo']), times jitted, after warm-up, interleaved (median of --repeats):
  processing: greedy verify (argmax + match) vs rejection sampling on the processed
    distributions at T=1, T=0.7, top-k 50, top-p 0.95, top-k 50 + top-p 0.95, through
    `rejection_verify_logits` (row by row up to the first rejection on CPU), plus top-p
    over all rows (`rejection_verify`, the cost when every draft is accepted) and the
    previous full-sort top-p. Logits: the demo checkpoint (--target) teacher-forced on
    --text when it exists, else the random-weight target's;
  verify step: one cached forward of `rows` tokens (cache filled to --context) of the
    random-weight target plus that processing on its logits.
The drafts are the logits' argmax: the best deterministic drafter, so acceptance is as
high as the distribution allows; τ is the mean accepted + 1 of the processing runs. The
CPU may be shared: run it a few times and compare ratios, not absolute times.
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from configs.common import MODEL_PRESETS  # noqa: E402
from dspec import checkpoint  # noqa: E402
from dspec.bench.timing import median_times  # noqa: E402
from dspec.sampling import SamplingSpec, processed_probs  # noqa: E402
from dspec.decoding.verification import (first_argmax, greedy_verify,  # noqa: E402
                                         rejection_verify, rejection_verify_logits)
from dspec.models.config import TransformerConfig  # noqa: E402
from dspec.models.transformer import Transformer  # noqa: E402
from dspec.tokenizer import load_tokenizer  # noqa: E402

_BATCH_SIZES = flags.DEFINE_list('batch_sizes', ['1', '16'], 'Batch sizes B.')
_ROWS = flags.DEFINE_integer('rows', 16, 'Verify rows per sequence (drafts + 1).')
_CONTEXT = flags.DEFINE_integer('context', 256, 'Cached positions before the verify rows.')
_REPEATS = flags.DEFINE_integer('repeats', 9, 'Timed runs per measurement (median).')
_TARGET = flags.DEFINE_string('target', 'demo/target',
                              'Checkpoint whose logits feed the processing timings; '
                              'random-weight logits when it does not exist.')
_TOKENIZER = flags.DEFINE_string('tokenizer', 'demo/tokenizer', 'Tokenizer of --target.')
_TEXT = flags.DEFINE_string('text', 'dspec/decoding/verification.py',
                            'Text the checkpoint is teacher-forced on.')

# name -> (temperature, top_k, top_p, all rows at once); None = greedy.
SETTINGS = {'greedy': None, 'T=1': (1.0, 0, 1.0, False), 'T=0.7': (0.7, 0, 1.0, False),
            'top-k 50': (1.0, 50, 1.0, False), 'top-p 0.95': (1.0, 0, 0.95, False),
            'top-k 50 + top-p 0.95': (1.0, 50, 0.95, False),
            'top-p 0.95, all rows': (1.0, 0, 0.95, True),
            'top-p 0.95, all rows, full sort (before)': 'sort'}


def _sorted_top_p(logits, temperature, top_p):
  """The previous top-p: sort the whole vocabulary (kept for the comparison only)."""
  probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  sorted_probs = jnp.sort(probs, axis=-1)[..., ::-1]
  cum_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  threshold = jnp.min(jnp.where(cum_before < top_p, sorted_probs, jnp.inf), axis=-1,
                      keepdims=True)
  probs = jnp.where(probs >= threshold, probs, 0.0)
  return probs / jnp.sum(probs, axis=-1, keepdims=True)


def _verify(setting, key, logits_BG1V):
  """(num_accepted, emitted) of one verify step's processing, drafts = the argmax."""
  draft_BG = first_argmax(logits_BG1V[:, :-1])
  num_B = jnp.full(draft_BG.shape[:1], draft_BG.shape[1], jnp.int32)
  if setting is None:
    return greedy_verify(draft_BG, num_B, logits_BG1V)
  if setting == 'sort':
    return rejection_verify(key, draft_BG, num_B, None, _sorted_top_p(logits_BG1V, 1.0, 0.95))
  t, k, top_p, all_rows = setting
  probs_fn = lambda x: processed_probs(x, SamplingSpec.create(t, k, top_p), t, top_p)
  if all_rows:
    return rejection_verify(key, draft_BG, num_B, None, probs_fn(logits_BG1V))
  return rejection_verify_logits(key, draft_BG, num_B, None, logits_BG1V, probs_fn)


def _checkpoint_logits(rows: int):
  """[n, rows, V] logits of --target teacher-forced on --text, or None without it."""
  if not os.path.isdir(_TARGET.value):
    return None
  meta = checkpoint.read_model_metadata(_TARGET.value, 'target')
  cfg = TransformerConfig.from_dict(meta['config'])
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  checkpoint.load_model_state(_TARGET.value, model, 'target')
  with open(_TEXT.value) as f:
    ids = load_tokenizer(_TOKENIZER.value, cfg.vocab_size).encode(f.read())
  ids = ids[:len(ids) // rows * rows][:1024]
  logits = np.asarray(model(jnp.asarray([ids])).logits_BTV[0])
  return logits.reshape(-1, rows, logits.shape[-1])


def _entropy_note(logits) -> str:
  p = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  h = -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
  return f'mean entropy at T=1 {float(jnp.mean(h)):.2f} nats'


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  rows = _ROWS.value
  cfg = TransformerConfig(**MODEL_PRESETS['demo'])
  target = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(target)
  real = _checkpoint_logits(rows)
  settings = SETTINGS
  key = jax.random.PRNGKey(0)
  process = jax.jit(_verify, static_argnums=(0,))

  @functools.partial(jax.jit, static_argnums=(0,))
  def step(setting, params, cache, key, tokens_BG1):
    out = nnx.merge(graphdef, params)(tokens_BG1, cache=cache)
    return _verify(setting, key, out.logits_BTV)

  print(f'demo target shape, vocab {cfg.vocab_size}, {rows} verify rows, context '
        f'{_CONTEXT.value}, backend {jax.default_backend()}; median of {_REPEATS.value} '
        'interleaved runs after warm-up (ms)')
  for b in map(int, _BATCH_SIZES.value):
    rng = np.random.default_rng(b)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, rows)), jnp.int32)
    cache = target.init_cache(b, _CONTEXT.value + rows).with_lengths(
        jnp.full((b,), _CONTEXT.value, jnp.int32))
    if real is not None:
      idx = rng.integers(0, real.shape[0], b)
      logits, source = jnp.asarray(real[idx]), f'{_TARGET.value} on {_TEXT.value}'
    else:
      logits = jax.jit(lambda p, c, t: nnx.merge(graphdef, p)(t, cache=c).logits_BTV)(
          params, cache, tokens)
      source = 'random-weight target'
    proc = median_times([lambda s=s: process(s, key, logits) for s in settings.values()],
                        repeats=_REPEATS.value, warmup=2)
    taus = [1 + float(jnp.mean(process(s, key, logits)[0])) for s in settings.values()]
    full = median_times([lambda s=s: step(s, params, cache, key, tokens)
                         for s in settings.values()], repeats=_REPEATS.value, warmup=2)
    print(f'\nB={b}: rows [{b}, {rows}, {cfg.vocab_size}]; processing logits: {source} '
          f'({_entropy_note(logits)})')
    print('| setting | τ | processing ms | ÷ greedy | verify step ms | ÷ greedy |')
    print('|---|---|---|---|---|---|')
    for name, tau, p, f in zip(settings, taus, proc, full):
      print(f'| {name} | {tau:.2f} | {p * 1e3:.2f} | {p / proc[0]:.2f} | {f * 1e3:.2f} | '
            f'{f / full[0]:.3f} |')


if __name__ == '__main__':
  app.run(main)
