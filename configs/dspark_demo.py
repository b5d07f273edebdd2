"""DSpark drafter for the demo target: the DFlash backbone, anchor-first blocks, a Markov
head and a confidence head (training.task = dspark, `dspec/models/dspark.py`).

Commands (after demo/target and demo/distill_demo8k exist, see configs/distill_demo.py):
  python scripts/train.py --config=configs/dspark_demo.py:layers=1,block=15,steps=1500 \
      --workdir=runs/dspark_demo   # the family's budget and DFlash's 15 drafts
  python scripts/train.py --config=configs/dspark_demo.py:deep,layers=5 \
      --workdir=runs/dspark_l5     # the deep recipe on a deep backbone
  python scripts/train.py --config=configs/dspark_demo.py:deep,layers=4,block=15 \
      --config.training.init_from=demo/dflash --config.training.num_steps=300 \
      --workdir=runs/dspark_l4    # fine-tuned on the deep DFlash backbone, heads fresh
  python scripts/train.py --config=configs/dspark_demo.py:deep,layers=4,block=16 \
      --config.dspark.sample_from_anchor=False --config.training.init_from=demo/dflash \
      --workdir=runs/dspark_l4_dflash_layout   # DFlash's layout: starts at its τ
  python scripts/decode.py --config=configs/dspark_demo.py --config.compare_ar=True
  python scripts/plot_dspark_confidence.py --config=configs/dspark_demo.py \
      --out=runs/dspark_demo/confidence.png   # per-position acceptance vs confidence
Arguments: layers=N (draft layers, default 2), block=B (drafts per block, default 7; 3
with tiny), head=vanilla|gated|rnn (Markov head), rank=r (Markov rank, default 32, which
keeps the demo drafter's size near DFlash's; 0 = none), deep, anchors=N, batch=N,
epochs=E (the block drafters' recipe, as in configs/dflash_demo.py), steps=N, minutes=M
(wall-clock cap), data=DIR (distilled data, default demo/distill_demo8k), tiny (random
tiny target, tiny drafter: for tests).
Training knobs (--config.dspark.<key>): ce_weight / tv_weight / confidence_weight (0.1 /
0.9 / 1.0), loss_gamma (0: 4 for B=7), enable_confidence_head, confidence_head_with_markov,
calibrate (fit the confidence temperatures on held-out data at export), sample_from_anchor
(False: DFlash's block layout, the anchor's slot predicts nothing and B − 1 slots draft,
so a DFlash export is this drafter with zero heads).
Decode knobs (--config.drafters.dspark.<key>): num_draft (<= the trained block; 0 =
trained), verify_cost (λ of the per-row verify-length cost model 1 + λ·n with
verify_length=fixed; 0 verifies every draft; under verify_length=auto λ is fitted per batch
size to the controller's step-cost table instead), verify_budget (most drafts verified per
step over the batch; 0 = no budget).
Expected: training logs loss, ce, tv, bce, acc1, tau_est (greedy τ estimate), accept_len
(expected τ under sampling), alpha, conf_mae and, at evaluation, ece_raw / ece (the
confidence's prefix-survival calibration error before / after temperature scaling), and
exports <workdir>/final with the fitted temperatures.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, tiny=False, layers=2, block=0, head='vanilla', rank=32,
                          steps=3000, minutes=0.0, data='demo/distill_demo8k',
                          **common.BLOCK_RECIPE_ARGS)
  block = args.block or (3 if args.tiny else 7)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  cfg.drafter = 'dspark'
  cfg.max_new_tokens = 128
  cfg.drafters.dspark.path = 'runs/dspark_demo/final'
  cfg.drafters.dspark.num_draft = block

  cfg.dspark = ml_collections.ConfigDict({
      'num_layers': args.layers,
      'block_size': block,
      'target_layer_ids': (),      # () -> round(1 + i(L-4)/(n-1))
      'mask_token_id': -1,         # -1 -> the tokenizer's <|mask|>
      'sliding_window': 0,         # 0 = full context
      'attention_impl': 'xla',     # xla | pallas
      'num_anchors': 16,           # blocks per sequence
      'anchor_supervised': False,  # False: the last prompt token is an anchor too
      'sample_from_anchor': True,  # anchor-first blocks; False: DFlash's (B − 1 drafts)
      'loss_gamma': 0.0,           # 0 -> the DFlash value of block B + 1 (4 for B = 7)
      'markov_rank': args.rank,
      'markov_head_type': args.head,
      'enable_confidence_head': True,
      'confidence_head_with_markov': True,
      'ce_weight': 0.1,
      'tv_weight': 0.9,
      'confidence_weight': 1.0,
      'calibrate': True,
  })
  t = common.drafter_training(cfg, 'dspark', args.data, args.steps, args.minutes)
  common.block_recipe(t, cfg.dspark, args)

  if args.tiny:
    cfg.model = common.model_config('tiny')
    cfg.max_new_tokens = 16
    cfg.timing_repeats = 1
    cfg.dspark.update(num_layers=1, num_anchors=4, markov_rank=8)
    t.update(num_steps=4, batch_size=2, seq_len=32, log_every=2, eval_every=2,
             ckpt_every=4, eval_windows=4, learning_rate=3e-3)
  return cfg
