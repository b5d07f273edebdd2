"""DFlash vs BD3-LM objective on the frozen demo target: same drafter, data and batches.

Command (after demo/target and demo/distill_demo8k exist, see configs/distill_demo.py):
  python scripts/sweep.py --config=configs/dflash_objectives.py --out_dir=runs/dflash_objectives
Arguments: steps=N per variant (default 150), layers, vocab (as configs/dflash_demo.py).
Both drafters are scored by the same held-out DFlash metric (random anchors, one pass:
slot-1 accuracy acc1 and the greedy τ estimate tau_est), which is how they draft.
Expected: <out_dir>/results.md with one row per objective.
"""

from configs import common, dflash_demo

VARIANTS = (
    ('dflash', ()),
    ('bd3lm', (('training.task', 'bd3lm'),)),
)


def get_config(arg=None):
  args = common.parse_arg(arg, steps=150, layers=1, vocab=1024)
  cfg = dflash_demo.get_config(f'steps={args.steps},layers={args.layers},vocab={args.vocab}')
  cfg.training.update(log_every=args.steps, eval_every=args.steps, ckpt_every=args.steps,
                      eval_windows=128)
  cfg.sweep = dict(variants=VARIANTS, metrics=('acc1', 'tau_est', 'loss'))
  return cfg
