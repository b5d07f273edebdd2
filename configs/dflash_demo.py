"""DFlash drafter for the demo target: train it (DFlash or BD3-LM objective) and decode with it.

Commands (after demo/target and demo/distill_demo8k exist, see configs/distill_demo.py):
  python scripts/train.py --config=configs/dflash_demo.py --workdir=runs/dflash_demo
  python scripts/train.py --config=configs/dflash_demo.py:bd3lm --workdir=runs/bd3lm_demo
  python scripts/decode.py --config=configs/dflash_demo.py --config.compare_ar=True
  python scripts/decode.py --config=configs/dflash_demo.py \
      --config.drafters.dflash.path=runs/bd3lm_demo/final --config.compare_ar=True
The deep recipe (the reference's: many anchors per row, several epochs; z-lab's taps for
the depth), one run per depth of the depth sweep:
  python scripts/train.py --config=configs/dflash_demo.py:deep,layers=5 --workdir=runs/dflash_l5
Arguments: layers=N (draft layers, default 2), block=B (trained block, default 16),
deep (128 anchors per row, batch 4 rows, 4 epochs, WSD schedule, bf16 exports),
anchors=N, batch=N, epochs=E (overrides; epochs sets steps from the demo's row count),
vocab=N (reduced draft head over the N most frequent target-written tokens; 0 = full),
steps=N, minutes=M (wall-clock cap), data=DIR (distilled data, default demo/distill_demo8k), bd3lm (BD3-LM objective), tiny (random tiny target,
tiny drafter, B=4: for tests). Decode knobs: --config.drafters.dflash.num_draft (< the
trained block; 0 = trained), .denoise_steps (1 = the reference single pass).
Expected: training logs loss, acc1 and tau_est (greedy τ estimate on held-out blocks) and
exports <workdir>/final; decoding prints lossless=True and τ. Cost on the 2-core dev CPU
(shared): ~3.6 s per DFlash step at batch 4 (2 layers, B=16, 16-32 anchors), so use
minutes=M to cap a CPU run; on a GPU the defaults take minutes.
"""

import ml_collections

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, tiny=False, bd3lm=False, layers=2, block=16, steps=3000,
                          minutes=0.0, vocab=0, data='demo/distill_demo8k',
                          **common.BLOCK_RECIPE_ARGS)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  cfg.drafter = 'dflash'
  cfg.max_new_tokens = 128
  cfg.drafters.dflash.path = 'runs/bd3lm_demo/final' if args.bd3lm else 'runs/dflash_demo/final'
  cfg.drafters.dflash.num_draft = args.block - 1

  cfg.dflash = ml_collections.ConfigDict({
      'num_layers': args.layers,
      'block_size': args.block,
      'target_layer_ids': (),      # () -> round(1 + i(L-4)/(n-1)); e.g. (1, 3, 5)
      'mask_token_id': -1,         # -1 -> the tokenizer's <|mask|> (id 1 in the demo)
      'sliding_window': 0,         # 0 = full context
      'draft_vocab_size': args.vocab,  # 0 = full; N = head over the N tokens the target
                                       # writes most often (FR-Spec): a cheaper draft pass
      'attention_impl': 'xla',     # xla | pallas
      'num_anchors': 16,           # DFlash: blocks per sequence
      'anchor_supervised': False,  # True: anchor must be target-written (reference);
                                   # False: the last prompt token is an anchor too
      'loss_gamma': 0.0,           # 0 -> 7 for B=16, 5 for 10, 4 for 8
      'eps_min': 0.25,             # BD3-LM: clipped noise range of t
      'eps_max': 1.0,
      'keep_first': True,          # BD3-LM: first token of each block stays clean
  })
  t = common.drafter_training(cfg, 'bd3lm' if args.bd3lm else 'dflash', args.data,
                              args.steps, args.minutes)
  common.block_recipe(t, cfg.dflash, args)

  if args.tiny:
    cfg.model = common.model_config('tiny')
    cfg.max_new_tokens = 16
    cfg.timing_repeats = 1
    cfg.drafters.dflash.num_draft = 3
    cfg.dflash.update(num_layers=1, block_size=4, num_anchors=4)
    t.update(num_steps=4, batch_size=2, seq_len=32, log_every=2, eval_every=2,
             ckpt_every=4, eval_windows=4, learning_rate=3e-3)
  return cfg
