"""Train the demo target: a Qwen3-style 8-layer LM (~15.7M params) on stdlib Python + GSM8K.

Commands (the demo chain, step 1 after the tokenizer):
  python scripts/train_tokenizer.py --out_dir=demo/tokenizer --vocab_size=8192
  python scripts/train.py --config=configs/demo_target.py --workdir=runs/demo_target
Quick check: --config=configs/demo_target.py:quick (tiny model, a few steps, < 1 min).
Expected: held-out loss per domain is logged as eval/heldout_loss/<corpus>; the final
model (bf16 storage) is exported to <workdir>/final and copied to demo/target.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, quick=False, minutes=0.0, steps=6000)
  cfg = common.decode_config('demo')
  cfg.model.tokenizer_dir = 'demo/tokenizer'
  cfg.training = common.training_config('target')
  t = cfg.training
  t.num_steps = args.steps
  t.batch_size = 16
  t.seq_len = 256
  t.learning_rate = 2e-3
  t.storage_dtype = 'bfloat16'
  t.max_minutes = args.minutes
  if args.quick:
    cfg.model.shape = dict(common.MODEL_PRESETS['tiny'], vocab_size=8192)
    t.num_steps, t.batch_size, t.seq_len = 4, 2, 32
    t.log_every = t.eval_every = t.ckpt_every = 2
    t.eval_windows = 4
    t.mixture = {'gsm8k': 1.0}
  return cfg
