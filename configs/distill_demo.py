"""Self-distil the demo target on training-side prompts (never benchmark prompts).

Command (after configs/demo_target.py has produced demo/target):
  python scripts/distill.py --config=configs/distill_demo.py --out_dir=demo/distill_demo8k
Presets: `:tiny` (random tiny target, a handful of prompts; for tests), `sampled` (T=0.7).
Expected: 16 shards of prompt + continuation with a loss mask on the target-written tokens
(~17 min on the 2-core CPU); rerunning resumes. The demo ships this output (1.2 MB), so the
demo's drafter trainings start at once on a fresh machine.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, tiny=False, sampled=False, gsm8k=3500, stdlib=4500)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  cfg.distill = dict(prompt_sets={'gsm8k_train': args.gsm8k,
                                  'python_stdlib_train': args.stdlib},
                     max_new_tokens=128, max_prompt_tokens=192, batch_size=32,
                     shard_size=512)
  if args.sampled:
    cfg.temperature, cfg.top_p = 0.7, 0.95
  if args.tiny:
    cfg.model = common.model_config('tiny')
    cfg.distill.prompt_sets = {'gsm8k_train': 6, 'python_stdlib_train': 5}
    cfg.distill.update(max_new_tokens=8, max_prompt_tokens=24, batch_size=4, shard_size=4)
  return cfg
