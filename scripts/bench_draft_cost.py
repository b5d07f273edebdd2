"""Draft pass vs verify pass: python scripts/bench_draft_cost.py --config=configs/demo.py.

Times the configured drafter's `propose` (and per-step `update`) against the target's
verify forward over γ+1 tokens on the decode state of the configured prompt (see
dspec/bench/draft_cost.py). The DFlash goal is a draft pass <= 0.25x a verify pass at
B=16. `--random_dflash_layers=N --random_dflash_vocab=V` measures an untrained DFlash
drafter of that shape instead (for sizing one before training it).
`--tree_nodes=32` also prices a 32-node tree verify against the chain (tree verification).
`--verify_curve=1,2,4,8,16,32` also prices a verify over k tokens against one AR step, and
the draft pass in AR steps (`--config.batch_size=16` at B = 16; `configs/demo.py:small` on
the cache-resident target).
Expected: one line `draft/verify = ...` (and with --tree_nodes one `verify: tree ...`, with
--verify_curve one `verify k tokens / AR step: ...`) and, with --out, a JSON of the timings.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, files  # noqa: E402
from dspec.errors import UserError  # noqa: E402

_CONFIG = cli.define_config('configs/demo.py', 'Decode config file.')
_OUT = flags.DEFINE_string('out', None, 'Where to write the timings JSON.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace an --out file that dspec did not write.')
_REPEATS = flags.DEFINE_integer('repeats', 30, 'Timed repeats (median).')
_RANDOM_LAYERS = flags.DEFINE_integer('random_dflash_layers', 0,
                                      'Measure an untrained DFlash drafter of N layers.')
_TREE_NODES = flags.DEFINE_integer('tree_nodes', 0, 'Also time a verify pass over a tree of '
                                   'this many nodes against the chain and a chain of as '
                                   'many tokens (0: off).')
_VERIFY_CURVE = flags.DEFINE_list('verify_curve', [], 'Verify widths k to price against one '
                                  'AR step (empty: off).')
_RANDOM_VOCAB = flags.DEFINE_integer('random_dflash_vocab', 0,
                                     'Its draft vocabulary size (0 = the full vocabulary).')


def _random_dflash(cfg, target):
  from flax import nnx

  from dspec.decoding.drafters import dflash
  from dspec.models import dflash as dflash_model
  vocab = range(_RANDOM_VOCAB.value) if _RANDOM_VOCAB.value else ()
  dcfg = dflash_model.DFlashConfig.create(
      target.cfg.num_layers, num_layers=_RANDOM_LAYERS.value,
      block_size=(cfg.drafters.dflash.num_draft or 15) + 1, mask_token_id=1,
      draft_vocab=vocab)
  return dflash.DFlashDrafter.create(dflash_model.DFlashModel(dcfg, target.cfg,
                                                                rngs=nnx.Rngs(0)))


def main(argv):
  del argv
  files.check_outputs({'--out': _OUT.value}, files.config_inputs(_CONFIG.value),
                      force=_FORCE.value)
  from flax import nnx

  from dspec import loading
  from dspec.bench.draft_cost import draft_vs_verify, tree_vs_chain_verify, verify_curve
  from dspec.decoding import runner
  from dspec.decoding.drafters import registry
  from dspec.decoding.prompts import encode_prompts, pad_prompts
  cfg = _CONFIG.value
  try:
    widths = [int(k) for k in _VERIFY_CURVE.value]
  except ValueError:
    raise UserError(f'--verify_curve must list integers, got {_VERIFY_CURVE.value}') from None
  if any(k < 1 or k > 1024 for k in widths):
    raise UserError(f'--verify_curve widths must be in [1, 1024], got {widths}')
  target, tokenizer, max_seq_len = loading.build_target(cfg.model)
  prompt_BP, prompt_len_B = pad_prompts(
      encode_prompts(runner.configured_prompts(cfg), tokenizer, target.cfg.vocab_size,
                     max_seq_len, cfg.max_new_tokens), cfg.batch_size)
  if _RANDOM_LAYERS.value:
    drafter, dparams = _random_dflash(cfg, target)
    method = f'dflash (untrained, {_RANDOM_LAYERS.value} layers, vocab ' \
             f'{_RANDOM_VOCAB.value or target.cfg.vocab_size})'
  else:
    drafter, dparams = registry.build_drafter(cfg, target)
    method = cfg.drafter
  graphdef, tparams = nnx.split(target)
  engine = runner.speculative_engine(graphdef, drafter, verify_length='fixed')
  state = engine.prefill(tparams, dparams, prompt_BP, prompt_len_B,
                         max_new_tokens=cfg.max_new_tokens)
  path = '' if _RANDOM_LAYERS.value else cfg.drafters.get(cfg.drafter, {}).get('path', '')
  result = dict(method=method, path=path, widen_mlp=cfg.model.get('widen_mlp', 1),
                prompt_tokens=int(prompt_len_B[0]),
                **draft_vs_verify(engine, tparams, dparams, state, _REPEATS.value))
  print(f'{method}: γ={result["num_draft"]} propose {1e3 * result["propose_s"]:.2f} ms, '
        f'update {1e3 * result["update_s"]:.2f} ms, verify {1e3 * result["verify_s"]:.2f} ms; '
        f'draft/verify = {result["draft_over_verify"]:.3f} '
        f'(propose/verify {result["propose_over_verify"]:.3f})')
  if _TREE_NODES.value:
    tree = tree_vs_chain_verify(graphdef, tparams, state.cache, _TREE_NODES.value,
                                drafter.num_draft + 1, drafter.taps, _REPEATS.value)
    result['tree'] = tree
    print(f'verify: tree of {tree["tree_nodes"]} nodes {1e3 * tree["tree_verify_s"]:.2f} ms, '
          f'chain of {tree["chain_tokens"]} {1e3 * tree["chain_verify_s"]:.2f} ms, chain of '
          f'{tree["tree_nodes"]} {1e3 * tree["same_count_chain_verify_s"]:.2f} ms; tree/chain '
          f'= {tree["tree_over_chain"]:.2f}, tree/same-count chain = '
          f'{tree["tree_over_same_count_chain"]:.2f}')
  if widths:
    curve = verify_curve(graphdef, tparams, state.cache, widths, drafter.taps, _REPEATS.value)
    result['verify_curve'] = curve
    ar_s = curve['seconds'][1]
    result['draft_in_ar_steps'] = (result['propose_s'] + result['update_s']) / ar_s
    import jax
    from dspec.bench.timing import read_bandwidth_bytes_per_s
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(tparams))
    roofline_s = weight_bytes / read_bandwidth_bytes_per_s(weight_bytes)
    result.update(weight_bytes=weight_bytes, weight_read_s=roofline_s)
    print('verify k tokens / AR step: ' + ', '.join(
        f'k={k} {r:.2f}' for k, r in curve['over_ar_step'].items()) +
          f' (AR step {1e3 * ar_s:.2f} ms, B={curve["batch_size"]}, '
          f'{ar_s / roofline_s:.2f}x the {1e3 * roofline_s:.2f} ms read of '
          f'{weight_bytes / 1e6:.0f} MB of weights); draft pass = '
          f'{result["draft_in_ar_steps"]:.2f} AR steps')
  if _OUT.value:
    files.write_json_atomic(_OUT.value, files.mark(result, 'bench_draft_cost'))


if __name__ == '__main__':
  cli.run(main)
