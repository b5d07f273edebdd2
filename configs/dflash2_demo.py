"""DFlash-2 drafter for the demo target: the DFlash demo recipe plus the conv tail and the
candidate selector (training.task = dflash2, `dspec/models/dflash2.py`).

Commands (after demo/target and demo/distill_demo8k exist, see configs/distill_demo.py):
  python scripts/train.py --config=configs/dflash2_demo.py:layers=1,steps=1500 \
      --workdir=runs/dflash2_demo
  python scripts/train.py --config=configs/dflash2_demo.py:deep,layers=4 \
      --config.training.init_from=demo/dflash --config.training.num_steps=350 \
      --workdir=runs/dflash2_l4   # fine-tuned on the deep DFlash backbone, heads fresh
  python scripts/decode.py --config=configs/dflash2_demo.py --config.compare_ar=True
  python scripts/export_drafter.py --path=runs/dflash2_demo/final --out=/tmp/dflash2_zlab
Arguments: those of configs/dflash_demo.py (layers, block, steps, minutes, data, tiny),
except vocab and bd3lm (DFlash-2 uses the full vocabulary and its own objective). The
family's shared budget (docs/RESULTS.md): layers=1, steps=1500, batch 8 × 320.
DFlash-2 knobs (--config.dflash.<key>): conv_kernel_size (taps along the block),
conv_group_size (channels per dynamic kernel), selector_rank (r), selector_top_k (K),
selector_loss_alpha (α of the K-way selector CE).
Expected: training logs loss (DFlash loss + α·sel_loss), unary_loss, sel_loss, acc1,
tau_est (unary greedy τ estimate), sel_tau_est (the selector walk's teacher-forced τ
estimate) and recall (gold in the unary top-K), and exports <workdir>/final.
"""

from configs import dflash_demo


def get_config(arg=None):
  cfg = dflash_demo.get_config(arg)
  if cfg.training.task != 'dflash' or cfg.dflash.draft_vocab_size:
    raise ValueError('dflash2_demo takes no bd3lm or vocab argument (DFlash-2 trains its own '
                     'objective over the full vocabulary)')
  cfg.training.task = 'dflash2'
  cfg.drafters.dflash.path = 'runs/dflash2_demo/final'
  cfg.dflash.update({
      'conv_kernel_size': 2,       # taps along the block (z-lab's DFlash-2: 2)
      'conv_group_size': 16,       # channels sharing one dynamic kernel (z-lab: 16)
      'selector_rank': 32,         # r of the predecessor/successor codebooks (z-lab: 256;
                                   # 2·V·r params: 32 keeps the demo drafter near DFlash's)
      'selector_top_k': 16,        # K candidates per slot
      'selector_loss_alpha': 1.0,  # loss = DFlash loss + α · K-way selector CE
  })
  if cfg.dflash.block_size <= 4:   # the tiny preset
    cfg.dflash.update(selector_rank=8, selector_top_k=4)
  return cfg
