"""Chained MTP (DeepSeek-V3) drafter for the demo target: train it, then decode with it.

Commands (after demo/target and demo/distill_demo8k exist, see configs/distill_demo.py):
  python scripts/train.py --config=configs/mtp_demo.py --workdir=runs/mtp_demo
  python scripts/decode.py --config=configs/mtp_demo.py --config.compare_ar=True
  python scripts/decode.py --config=configs/mtp_demo.py --config.drafters.mtp.num_draft=1
The family's MTP (docs/RESULTS.md, "Training recipes": the shared drafter budget, one
layer's parameters):
  python scripts/train.py --config=configs/mtp_demo.py:steps=1500 \
      --config.mtp.shared_depth=True --workdir=runs/mtp_demo
Joint pretraining (a fresh demo-shaped target + MTP on the target corpora, λ 0.3 -> 0.1):
  python scripts/train.py --config=configs/mtp_demo.py:joint --workdir=runs/mtp_joint
  python scripts/decode.py --config=configs/mtp_demo.py:joint --config.compare_ar=True
Arguments: depths=D (1..4, default 3), beta (per-depth loss decay, default 0.6 post-hoc,
1.0 joint), steps, minutes (wall-clock cap), data=DIR (distilled data), vocab=V (post-hoc:
a reduced draft vocabulary of the V most target-written tokens, FastMTP's vocabulary
compression; 0 = full), joint, tiny (random tiny target and few steps:
for tests; pass --config.data.path / --config.drafters.mtp.path). Architecture knobs
(the ablation): --config.mtp.{kind,concat_order,h0_source,chain_hidden,
zero_pos0_embedding,share_final_norm,shared_depth}. Decode: drafters.mtp.num_draft
(0 = all trained depths), drafters.mtp.sample_proposals (T > 0: sampled drafts with q),
drafters.mtp.token_map (a JSON list of token ids, e.g. demo/token_map_2048.json from
scripts/token_map.py: a full-vocabulary MTP drafts from those tokens only).
drafters.mtp.path also takes a speculators `mtp` directory or a HF checkpoint with
DeepSeek-V3-layout MTP layers (num_nextn_predict_layers; dense blocks only), see
dspec/models/formats/mtp.py.
Expected: training logs loss_d{k} and agree_d{k} (top-1 agreement with the target, eval/
on held-out data) and exports <workdir>/final (joint: final/target and final/mtp);
decoding prints lossless=True and τ.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, tiny=False, joint=False, depths=3, beta=-1.0, steps=3000,
                          minutes=0.0, data='demo/distill_demo8k', vocab=0)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'runs/mtp_joint/final/target' if args.joint else 'demo/target'
  cfg.model.tokenizer_dir = 'demo/tokenizer'
  cfg.drafter = 'mtp'
  cfg.max_new_tokens = 128
  cfg.drafters.mtp.path = 'runs/mtp_joint/final/mtp' if args.joint else 'runs/mtp_demo/final'

  cfg.mtp = ml_collections.ConfigDict({
      'num_depths': args.depths,
      'kind': 'chained',              # chained | parallel (Gloeckle heads)
      'concat_order': 'emb_first',    # emb_first (DeepSeek checkpoints) | hidden_first (MiMo)
      'h0_source': 'post_norm',       # target hidden fed to depth 1: post_norm | pre_norm
      'chain_hidden': 'post_norm',    # depth k -> k+1: post_norm | pre_norm
      'zero_pos0_embedding': False,   # vLLM zeroes the token embedding at position 0
      'share_final_norm': False,      # True: the target's final norm instead of per-depth
      'shared_depth': False,          # one depth reused recursively (FastMTP)
      'draft_vocab_size': args.vocab,  # > 0: score only the most target-written tokens
  })
  t = common.drafter_training(cfg, 'mtp_joint' if args.joint else 'mtp_posthoc',
                              args.data, args.steps, args.minutes)
  t.mtp_beta = args.beta if args.beta > 0 else (1.0 if args.joint else 0.6)
  t.mtp_lambda_schedule = ((0.0, 0.3), (0.7, 0.1))   # (fraction of steps, λ): joint only
  t.eval_every = 250
  if args.joint:
    t.update(batch_size=16, seq_len=256, learning_rate=2e-3, weight_decay=0.1,
             storage_dtype='bfloat16')

  if args.tiny:
    cfg.model = common.model_config('tiny')
    cfg.drafters.mtp.path = ''
    cfg.max_new_tokens = 16
    cfg.timing_repeats = 1
    t.update(num_steps=4, batch_size=2, seq_len=32, log_every=2, eval_every=2,
             ckpt_every=4, eval_windows=4, learning_rate=3e-3, storage_dtype='float32')
    if args.joint:   # as configs/demo_target.py:quick
      cfg.model.shape['vocab_size'] = 8192
      cfg.model.tokenizer_dir = 'demo/tokenizer'
      t.mixture = {'gsm8k': 1.0}
  return cfg
