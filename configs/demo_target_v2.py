"""Demo v2 target: the demo family and tokenizer (~15.7M params), trained far longer on more
Python (stdlib + permissively licensed package sources) and GSM8K.

The run is long (many hours on 2 CPU cores) and resumable across machines:
  * same machine: the newest orbax checkpoint in --workdir restores everything;
  * fresh machine (no --workdir): a warm restart from the committed export demo/target_v2
    (bf16 params; `extra.train_step` in its metadata): the step and the schedule continue
    where they were, AdamW moments restart from zero (their un-bias-corrected ramp acts as
    a short re-warmup). Optimizer moments are not committed (2x the params' size).

Commands:
  # first start, from the v1 demo target (481 steps):
  python scripts/train.py --config=configs/demo_target_v2.py \
      --config.training.init_from=demo/target --config.training.continue_from_init=False \
      --workdir=runs/demo_target_v2
  # every later start (same machine or fresh):
  python scripts/train.py --config=configs/demo_target_v2.py --workdir=runs/demo_target_v2
  # commit a resumable state: cp -r runs/demo_target_v2/export demo/target_v2
  # finish: at step S, rerun with :steps=<S / (1 - decay_ratio)> so the final decay starts.
Quick check: --config=configs/demo_target_v2.py:quick (tiny model, a few steps, < 1 min).
Expected: eval/heldout_loss/<corpus> in the log (goal: <= 3.3 nats on python_stdlib and
gsm8k); bf16 exports in <workdir>/export every `export_every` steps and <workdir>/final.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, quick=False, minutes=0.0, steps=12000)
  cfg = common.decode_config('demo')
  cfg.model.tokenizer_dir = 'demo/tokenizer'
  cfg.training = common.training_config('target')
  t = cfg.training
  t.num_steps = args.steps
  t.batch_size = 16
  t.seq_len = 256
  t.learning_rate = 1.5e-3
  t.schedule = 'wsd'
  t.warmup_ratio = 0.01
  t.decay_ratio = 0.15
  t.storage_dtype = 'bfloat16'
  t.max_minutes = args.minutes
  t.init_from = 'demo/target_v2'
  t.continue_from_init = True
  t.log_every = 25
  t.eval_every = 250
  t.ckpt_every = 100
  t.export_every = 250
  # GSM8K train is ~1.3M tokens and the stdlib ~2.4M: package sources keep epochs low.
  t.mixture = {'python_stdlib': 0.3, 'python_packages': 0.5, 'gsm8k': 0.2}
  if args.quick:
    cfg.model.shape = dict(common.MODEL_PRESETS['tiny'], vocab_size=8192)
    t.num_steps, t.batch_size, t.seq_len = 4, 2, 32
    t.log_every = t.eval_every = t.ckpt_every = t.export_every = 2
    t.eval_windows = 4
    t.init_from, t.continue_from_init = '', False
    t.mixture = {'gsm8k': 1.0}
  return cfg
