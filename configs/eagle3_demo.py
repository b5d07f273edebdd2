"""EAGLE-3 drafter for the demo target: train it (training-time test) and decode with it.

Commands (after demo/target and demo/distill_demo8k exist, see configs/distill_demo.py):
  python scripts/train.py --config=configs/eagle3_demo.py --workdir=runs/eagle3_demo
  # the family's (docs/RESULTS.md, "Training recipes"): the shared budget of 1500 steps, and a draft
  # vocabulary of 1/4 of the target's as published EAGLE-3 drafters use (32k of 128k)
  python scripts/train.py --config=configs/eagle3_demo.py:steps=1500,vocab=2048 \
      --workdir=runs/eagle3_demo
  python scripts/decode.py --config=configs/eagle3_demo.py --config.compare_ar=True
A published checkpoint (speculators `eagle3` or legacy SafeAILab/SpecForge `midlayer.*`
directory) decodes the same way with --config.drafters.eagle3.path=<dir>.
Arguments: layers=N (draft layers, default 1), ttt=K (training-time-test steps = the
default draft length, default 7), vocab=N (reduced head over the N most frequent
target-written tokens; 0 = full), steps=N, minutes=M (wall-clock cap), data=DIR
(distilled data, default demo/distill_demo8k), soft (EAGLE-3's soft CE against the
target's distribution instead of the written token), tiny (random tiny target, K=3: for
tests). Decode knobs: --config.drafters.eagle3.num_draft (0 = ttt), .sample_proposals.
The data, batch, sequence length and step budget are those of configs/dflash_demo.py.
Expected: training logs loss, acc0..acc{K-1} and tau_est (teacher-forced greedy τ
estimate) and exports <workdir>/final; decoding prints lossless=True and τ.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, tiny=False, soft=False, layers=1, ttt=7, steps=3000,
                          minutes=0.0, vocab=0, data='demo/distill_demo8k')
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  cfg.drafter = 'eagle3'
  cfg.max_new_tokens = 128
  cfg.drafters.eagle3.path = 'runs/eagle3_demo/final'

  cfg.eagle3 = ml_collections.ConfigDict({
      'num_layers': args.layers,
      'target_layer_ids': (),      # () -> EAGLE-3's: outputs of layers 1, L//2-1, L-4
      'ttt_steps': args.ttt,
      'loss_decay': 0.8,           # step s weighs decay^s (EAGLE-3's 0.8)
      'soft_targets': args.soft,
      'draft_vocab_size': args.vocab,
      'norm_before_residual': False,
      'norm_before_fc': False,
      'fc_norm': False,
      'norm_output': False,
  })
  t = common.drafter_training(cfg, 'eagle3', args.data, args.steps, args.minutes)

  if args.tiny:
    cfg.model = common.model_config('tiny')
    cfg.max_new_tokens = 16
    cfg.timing_repeats = 1
    cfg.eagle3.update(ttt_steps=3, target_layer_ids=(1, 0, 1))
    t.update(num_steps=4, batch_size=2, seq_len=32, log_every=2, eval_every=2,
             ckpt_every=4, eval_windows=4, learning_rate=3e-3)
  return cfg
