"""Per-position acceptance and confidence of a DSpark drafter, side by side, on the
held-out rows of its distilled data (the rows `training.task=dspark` held out).

  python scripts/plot_dspark_confidence.py --config=configs/dspark_demo.py \
      [--config.drafters.dspark.path=runs/dspark_demo/final] \
      [--config.data.path=demo/distill_demo8k] --out=runs/dspark_demo/confidence.png

Blocks are anchored as in training (`dspark.num_anchors` per row, teacher-forced prefix).
For each slot k (draft k+1 of the block), over the valid blocks:

  acceptance   sampled: mean α_k = 1 − TV(p_draft, p_target) (rejection sampling's
               acceptance probability); greedy: share of draft argmax = target argmax
  confidence   mean σ(z_k / T_k), the confidence head with the checkpoint's calibration
               (the sampled or greedy temperatures; T = 1 where none is stored)

The PNG holds one panel per mode with the two as bars side by side per slot, the JSON
(`--json`, default: --out with .json) the same numbers plus the prefix survival (mean
Π_{j≤k} α_j against the calibrated Ŝ_k) and its ECE (`dspark_task.expected_calibration_error`).
The temperatures were fitted on the first half of these blocks, so the ECE here is not
fully held out; training's `ece` is (second half). Outputs follow dspec's output-path policy
(`dspec.files.check_outputs`): an existing file dspec did not write is kept unless --force,
and an output inside an input of the config is refused.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from dspec import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'DSpark config (dspark_demo).',
                                          lock_config=True)
_OUT = flags.DEFINE_string('out', None, 'PNG to write.', required=True)
_JSON = flags.DEFINE_string('json', None, 'JSON to write (default: --out with .json).')
_BATCH = flags.DEFINE_integer('batch_size', 8, 'Held-out rows per forward pass.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace --out / --json files dspec did not '
                           'write.')


def per_position(model, target, tokens, loss_mask, *, num_anchors: int,
                 anchor_supervised: bool, batch_size: int, seed: int = 0) -> dict:
  """Per-slot acceptance, confidence and prefix survival (see the module docstring)."""
  import jax
  import numpy as np
  from dspec.training import dspark_task
  from dspec.training.dflash_task import sample_anchors

  @jax.jit
  def terms(tokens_BS, mask_BS, key):
    anchors_BN = sample_anchors(key, mask_BS, num_anchors, anchor_supervised)
    t = dspark_task.dspark_terms(model, target, tokens_BS, mask_BS, anchors_BN, 1.0)
    return {k: t[k] for k in ('alpha', 'agree', 'valid', 'block_valid', 'conf')}

  parts = []
  for i in range(0, len(tokens), batch_size):
    short = batch_size - len(tokens[i:i + batch_size])   # pad with unsupervised rows
    pad = lambda a: np.pad(a[i:i + batch_size], ((0, short), (0, 0)))
    out = jax.device_get(terms(pad(tokens), pad(loss_mask), jax.random.key(seed + i)))
    ok = out.pop('block_valid')
    parts.append({k: v[ok] for k, v in out.items()})
  arr = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  valid = arr['valid']
  if not valid.any():
    raise ValueError('no valid held-out block: the held-out rows have no target-written '
                     'tokens to anchor on')
  count = np.maximum(valid.sum(0), 1)
  mean = lambda x: (np.where(valid, x, 0.0).sum(0) / count).tolist()
  report = {'blocks': int(len(valid)), 'valid_per_slot': valid.sum(0).tolist()}
  cfg = model.cfg
  for mode, key, temps in (('sampled', 'alpha', cfg.confidence_temperatures),
                           ('greedy', 'agree', cfg.greedy_confidence_temperatures
                            or cfg.confidence_temperatures)):
    accept = arr[key].astype(np.float64)
    pred, actual, ok = dspark_task.survival_arrays(arr['conf'], accept, valid, temps)
    conf = 1.0 / (1.0 + np.exp(-arr['conf'] / (np.asarray(temps) if temps else 1.0)))
    prefix_count = np.maximum(ok.sum(0), 1)
    report[mode] = {
        'temperatures': list(temps), 'acceptance': mean(accept), 'confidence': mean(conf),
        'survival': (np.where(ok, actual, 0.0).sum(0) / prefix_count).tolist(),
        'predicted_survival': (np.where(ok, pred, 0.0).sum(0) / prefix_count).tolist(),
        'ece': dspark_task.expected_calibration_error(pred[ok], actual[ok])}
  return report


def plot(report: dict, path: str, title: str) -> None:
  """Two panels (sampled, greedy): acceptance and confidence bars side by side per slot."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np
  from dspec.files import OUTPUT_KEY, write_atomic

  fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True, layout='constrained')
  for ax, mode in zip(axes, ('sampled', 'greedy')):
    r = report[mode]
    k = np.arange(1, len(r['acceptance']) + 1)
    ax.bar(k - 0.2, r['acceptance'], 0.4, color='C0', label='acceptance')
    ax.bar(k + 0.2, r['confidence'], 0.4, color='C1', label='confidence')
    ax.set_title(f'{mode}: ECE of the prefix survival {r["ece"]:.3f}')
    ax.set_xlabel('draft position k')
    ax.set_xticks(k)
  axes[0].set_ylabel('mean over held-out blocks')
  axes[0].set_ylim(0, 1)
  handles, labels = axes[0].get_legend_handles_labels()
  fig.legend(handles, labels, loc='outside lower center', ncols=2)
  fig.suptitle(title)
  mark = {OUTPUT_KEY: 'dspark confidence plot'}   # `files.written_by_dspec` reads it
  write_atomic(path, lambda tmp: fig.savefig(tmp, format='png', dpi=110, metadata=mark))
  plt.close(fig)


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  from dspec import files, loading
  from dspec.decoding.drafter import checkpoint_path
  from dspec.models.formats.dspark import load_dspark
  from dspec.training.distill import load_distilled, split_distilled
  cfg = _CONFIG.value
  if _BATCH.value < 1:
    raise cli.UserError(f'--batch_size must be >= 1, got {_BATCH.value}')
  json_path = _JSON.value or os.path.splitext(_OUT.value)[0] + '.json'
  files.check_outputs({'--out': _OUT.value, '--json': json_path}, files.config_inputs(cfg),
                      force=_FORCE.value)
  target, _, _ = loading.build_target(cfg.model)
  path = checkpoint_path(cfg, 'dspark')
  model = load_dspark(path, num_target_layers=target.cfg.num_layers)
  if model.confidence_head is None:
    raise cli.UserError(f'{path}: the drafter has no confidence head to plot')
  rows = split_distilled(load_distilled(cfg.data.path), cfg.training.seq_len,
                         cfg.data.heldout_fraction, cfg.training.eval_windows, cfg.data.path)
  report = per_position(model, target, rows.held_tokens, rows.held_mask,
                        num_anchors=cfg.dspark.num_anchors,
                        anchor_supervised=cfg.dspark.anchor_supervised,
                        batch_size=_BATCH.value, seed=cfg.training.seed)
  report.update(drafter=path, data=cfg.data.path)
  plot(report, _OUT.value, f'DSpark {os.path.basename(os.path.normpath(path))}: '
       f'{report["blocks"]} held-out blocks')
  files.write_json_atomic(json_path, files.mark(report, 'dspark confidence'), indent=2)
  for mode in ('sampled', 'greedy'):
    r = report[mode]
    print(f'{mode}: acceptance {[round(a, 3) for a in r["acceptance"]]} confidence '
          f'{[round(c, 3) for c in r["confidence"]]} ECE {r["ece"]:.3f}')
  print(f'wrote {_OUT.value} and {json_path}')


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  cli.run(main)
