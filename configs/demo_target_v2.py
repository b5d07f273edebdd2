"""Demo v2 target (demo/target): the demo family and tokenizer (~15.7M params), trained far
longer than v1 on more Python (stdlib + permissively licensed package sources) and GSM8K.

How demo/target was made (docs/RESULTS.md, "Training recipes"): warm-started from the v1
target (481 steps), then WSD (peak 1.5e-3, 1% warmup) over 2600 steps of batch 16 x 256 with
the last 15% decaying (from step 2210), across three sessions on the 2-core CPU. Held-out
loss at step 2600: gsm8k 2.71, stdlib 2.89, packages 2.46 nats.

The run is resumable across machines:
  * same machine: the newest orbax checkpoint in --workdir restores everything;
  * fresh machine (no --workdir): a warm restart from the export at `init_from` (bf16
    params; `extra.train_step` in its metadata): the step and the schedule continue where
    they were, AdamW moments restart from zero (their un-bias-corrected ramp acts as a short
    re-warmup). Optimizer moments are not committed (2x the params' size).

Commands:
  # first start, from the v1 demo target:
  python scripts/train.py --config=configs/demo_target_v2.py \
      --config.training.init_from=<v1 target> --config.training.continue_from_init=False \
      --workdir=runs/demo_target_v2
  # every later start (same machine or fresh), e.g. with a committed export in demo/target:
  python scripts/train.py --config=configs/demo_target_v2.py --workdir=runs/demo_target_v2
  # commit a resumable state: cp -r runs/demo_target_v2/export demo/target
  # train longer: steps=S with S > 2600 (a new WSD end; the decay restarts at 0.85 S)
Quick check: --config=configs/demo_target_v2.py:quick (tiny model, a few steps, < 1 min).
Expected: eval/heldout_loss/<corpus> in the log (goal: <= 3.3 nats on python_stdlib and
gsm8k); bf16 exports in <workdir>/export every `export_every` steps and <workdir>/final.
"""

from configs import common, demo_target


def get_config(arg=None):
  args = common.parse_arg(arg, quick=False, minutes=0.0, steps=2600)
  cfg = demo_target.get_config(f'steps={args.steps},minutes={args.minutes}'
                               + (',quick' if args.quick else ''))
  t = cfg.training
  t.learning_rate = 1.5e-3
  t.schedule = 'wsd'
  t.warmup_ratio = 0.01
  t.decay_ratio = 0.15
  if args.quick:
    t.export_every = 2
    return cfg
  t.init_from = 'demo/target'
  t.continue_from_init = True
  t.log_every = 25
  t.eval_every = 250
  t.ckpt_every = 100
  t.export_every = 250
  # GSM8K train is ~1.3M tokens and the stdlib ~2.4M: package sources keep epochs low.
  t.mixture = {'python_stdlib': 0.3, 'python_packages': 0.5, 'gsm8k': 0.2}
  return cfg
