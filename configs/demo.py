"""The main job: the demo target with its best drafter (MTP; docs/RESULTS.md) on a HumanEval prompt.

Command:
  python scripts/decode.py --config=configs/demo.py
  python scripts/decode.py --config=configs/demo.py:drafter=dflash2   # or eagle3, dspark, ...
  python scripts/decode.py --config=configs/demo.py --config.prompt_set=gsm8k_test
Expected: prints the completion, then a metrics line with tau, tokens/s for the drafter and AR
(same process, after warm-up), the speedup, and lossless=True. Figures: docs/RESULTS.md.
The chain that produced demo/ is in configs/demo_target.py, distill_demo.py and the
<drafter>_demo.py configs (commands: docs/RESULTS.md, "Training recipes").
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, drafter='mtp', index=0)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  for kind in ('mtp', 'eagle3', 'dflash', 'dspark'):
    cfg.drafters[kind].path = f'demo/{kind}'
  # DFlash-2 checkpoints load through the dflash drafter.
  cfg.drafter = 'dflash' if args.drafter == 'dflash2' else args.drafter
  if args.drafter == 'dflash2':
    cfg.drafters.dflash.path = 'demo/dflash2'
  cfg.prompt_set = 'humaneval'
  cfg.prompt_index = args.index
  cfg.max_new_tokens = 128
  cfg.compare_ar = True
  return cfg
