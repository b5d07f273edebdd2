"""Benchmark the demo target (demo/target) with every drafter against AR and transformers.

Commands (after the demo chain of configs/demo_target.py, mtp_demo.py and dflash_demo.py has
produced demo/target, demo/mtp and demo/dflash):
  python scripts/benchmark.py --config=configs/bench_demo.py:quick --out_dir=runs/bench_quick
  python scripts/benchmark.py --config=configs/bench_demo.py:goals --out_dir=runs/bench_goals
  python scripts/benchmark.py --config=configs/bench_demo.py --out_dir=runs/bench_full
  python scripts/benchmark.py --render=runs/bench_full   # section for docs/RESULTS.md
Presets: quick (< 10 min on a 2-core CPU: 2 prompts per dataset, 64 new tokens, T in {0, 1},
one size per method, batch 1, one HF prompt), goals (the issue goals' setting: HumanEval
and GSM8K test, 10 prompts each, 128 new tokens, greedy, batch 1, each method at its
trained size, 4 HF prompts; ~15 min) or full (the default, a few hours: 10 prompts
per dataset, 128 new tokens, T in {0, 1}, sizes (num_draft) {4, 8, 16} (DFlash {3, 7, 15}: blocks 4, 8, 16), batch {1, 4}, 4 HF prompts).
Prompts keep their last 256 (quick: 128) tokens, padded to that one width. Datasets:
HumanEval, GSM8K test and Spec-Bench's six groups (data/, or --config.data_dir).
An empty drafters.<m>.path skips that method.
Expected: results.json / results.md / plots; lossless_fraction 1.0 at T=0; the peer section
compares dspec with transformers generate (AR, prompt lookup, assisted).
"""

from configs import common, common_bench


def get_config(arg=None):
  args = common.parse_arg(arg, quick=False, full=False, goals=False)
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = 'demo/target'
  cfg.model.tokenizer_dir = 'demo/tokenizer'
  cfg.drafters.mtp.path = 'demo/mtp'
  cfg.drafters.dflash.path = 'demo/dflash'
  cfg.drafters.dflash.num_draft = 15
  cfg.max_new_tokens = 128
  cfg.timing_repeats = 3
  cfg.bench = common_bench.bench_section()
  b = cfg.bench
  b.num_prompts = 10
  b.method_sizes = {'mtp': (3,), 'dflash': (3, 7, 15)}
  b.batch_sizes = (1, 4)
  b.max_prompt_tokens = 256    # the target was trained on 256-token windows
  b.prompt_bucket = 256        # one prompt width: every engine compiles once
  b.hf.num_prompts = 4
  if args.quick:
    cfg.max_new_tokens = 64
    cfg.timing_repeats = 1
    b.num_prompts = 2
    b.temperatures = (0.0, 1.0)
    b.sizes = (8,)
    b.method_sizes = {'mtp': (3,), 'dflash': (15,)}
    b.batch_sizes = (1,)
    b.max_prompt_tokens = b.prompt_bucket = 128
    b.hf.num_prompts = 1
  if args.goals:
    cfg.timing_repeats = 1
    b.datasets = ('humaneval', 'gsm8k_test')
    b.temperatures = (0.0,)
    b.batch_sizes = (1,)
    b.sizes = (8,)
    b.method_sizes = {'mtp': (3,), 'dflash': (15,)}
  return cfg
