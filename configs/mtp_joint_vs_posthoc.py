"""Joint vs post-hoc MTP, from the same demo target, at the same step budget and batch.

Command (after demo/target and demo/distill_demo8k exist):
  python scripts/sweep.py --config=configs/mtp_joint_vs_posthoc.py --out_dir=runs/mtp_jvp
Variants, each `steps` steps (default 40) starting from demo/target:
  target_only  the target trained further alone on its corpora (the control for the trunk);
  joint        the target and a fresh D=3 MTP trained together on the corpora, gradients
               into the trunk (DeepSeek-V3: L_main + λ/D Σ L_k, λ 0.3 -> 0.1);
  posthoc      a fresh D=3 MTP on the frozen target's self-distilled outputs (FastMTP,
               β = 0.6).
Expected: <out_dir>/results.md with held-out LM loss per corpus (the trunk's; posthoc
leaves it at demo/target's) and, for both MTPs, per-depth agreement with their own target
and the chained τ estimate on held-out corpus text (corpus/...); posthoc also on held-out
self-distilled text (tau_est), which is what drafting sees.
"""

from configs import common, mtp_demo

VARIANTS = (
    ('target_only', (('training.task', 'target'),)),
    ('joint', ()),
    ('posthoc', (('training.task', 'mtp_posthoc'), ('model.path', 'demo/target'),
                 ('training.seq_len', 320), ('training.mtp_beta', 0.6),
                 ('training.weight_decay', 0.0))),
)


def get_config(arg=None):
  args = common.parse_arg(arg, steps=40)
  cfg = mtp_demo.get_config(f'joint,steps={args.steps}')
  t = cfg.training
  t.update(init_from='demo/target', corpus_eval=True, learning_rate=1e-3, eval_windows=64,
           log_every=args.steps, eval_every=args.steps, ckpt_every=args.steps,
           warmup_ratio=0.1)
  cfg.sweep = dict(variants=VARIANTS, metrics=(
      'heldout_loss/gsm8k', 'heldout_loss/python_stdlib', 'corpus/agree_d1',
      'corpus/agree_d2', 'corpus/agree_d3', 'corpus/tau_est', 'tau_est'))
  return cfg
