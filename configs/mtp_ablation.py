"""MTP knob ablation on the frozen demo target: one post-hoc D=3 run per knob, same batches.

Command (after demo/target and the distilled data exist, see configs/distill_demo.py):
  python scripts/sweep.py --config=configs/mtp_ablation.py --out_dir=runs/mtp_ablation
Arguments: steps=N per variant (default 80), data=DIR (default demo/distill_demo8k),
tiny (random tiny target, 2 steps, 2 variants: for tests; pass --config.data.path).
Expected: <out_dir>/results.md, one row per variant with held-out per-depth top-1
agreement with the target (agree_d1..3) and tau_est, the greedy τ of a 3-token MTP draft
estimated on held-out target-written text. Figures: docs/RESULTS.md, "Training recipes".
"""

from configs import common, mtp_demo

# (name, ((dotted config key, value), ...)): each changes one knob of the base recipe
# (chained, emb_first, post-norm hidden into depth 1 and along the chain, per-depth norm,
# per-depth loss decay β = 0.6).
VARIANTS = (
    ('base', ()),
    ('hidden_first', (('mtp.concat_order', 'hidden_first'),)),
    ('h0_pre_norm', (('mtp.h0_source', 'pre_norm'),)),
    ('chain_pre_norm', (('mtp.chain_hidden', 'pre_norm'),)),
    ('zero_pos0_embedding', (('mtp.zero_pos0_embedding', True),)),
    ('share_final_norm', (('mtp.share_final_norm', True),)),
    ('shared_depth', (('mtp.shared_depth', True),)),
    ('parallel_heads', (('mtp.kind', 'parallel'),)),
    ('beta_1', (('training.mtp_beta', 1.0),)),
)


def get_config(arg=None):
  args = common.parse_arg(arg, tiny=False, steps=80, data='demo/distill_demo8k')
  cfg = mtp_demo.get_config('tiny' if args.tiny else f'steps={args.steps}')
  cfg.data.path = args.data
  t = cfg.training
  t.update(batch_size=8, log_every=args.steps, eval_every=args.steps,
           ckpt_every=args.steps, eval_windows=128)
  cfg.sweep = dict(variants=VARIANTS,
                   metrics=('agree_d1', 'agree_d2', 'agree_d3', 'tau_est', 'loss_d1'))
  if args.tiny:
    cfg.sweep.variants = VARIANTS[:2]
    t.update(num_steps=2, log_every=2, eval_every=2, ckpt_every=2, eval_windows=4)
  return cfg
