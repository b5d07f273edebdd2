"""The main job: the demo target with its best drafter (MTP; docs/RESULTS.md) on a HumanEval prompt.

The target is demo/target widened WIDE_RATIO times in its MLPs (`dspec/models/widen.py`):
the same tokens as demo/target, so every demo drafter fits it, but its weights no longer sit
in a CPU's cache and decoding streams them from memory per token, as with a large model.
The `small` preset decodes on demo/target itself (cache-resident, compute-bound on a CPU).

Command:
  python scripts/decode.py --config=configs/demo.py
  python scripts/decode.py --config=configs/demo.py:small   # on demo/target itself
  python scripts/decode.py --config=configs/demo.py:drafter=dflash2   # or eagle3, dspark, ...
  python scripts/decode.py --config=configs/demo.py --config.prompt_set=gsm8k_test
Expected: a status line naming the widened target (params, MB), the completion, then a
metrics line with tau, tokens/s for the drafter and AR (same process, after warm-up), the
speedup, and lossless=True; `small` writes the same completion. Figures: docs/RESULTS.md.
The chain that produced demo/ is in configs/demo_target.py, distill_demo.py and the
<drafter>_demo.py configs (commands: docs/RESULTS.md, "Training recipes").
"""

from configs import common

# MLP widening of the default target (`small`: none).
WIDE_RATIO = 16


def get_config(arg=None):
  args = common.parse_arg(arg, drafter='mtp', index=0, small=False)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  cfg.model.widen_mlp = 1 if args.small else WIDE_RATIO
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
