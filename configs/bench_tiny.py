"""Tiny benchmark: random tiny target, ngram and suffix, two datasets (tests, smoke runs).

Command:
  python scripts/benchmark.py --config=configs/bench_tiny.py --out_dir=/tmp/bench_tiny
Arguments: nohf (skip the transformers peer), t0 (temperature 0 only).
Expected: about a minute on a 2-core CPU; results.json rows with lossless_fraction 1.0 at
T=0, results.md and four PNG plots. Random weights: the numbers mean nothing.
"""

from configs import common, common_bench


def get_config(arg=None):
  args = common.parse_arg(arg, nohf=False, t0=False)
  cfg = common.decode_config('tiny')
  cfg.max_new_tokens = 12
  cfg.timing_repeats = 1
  cfg.bench = common_bench.bench_section()
  b = cfg.bench
  b.datasets = ('humaneval', 'gsm8k_test')
  b.num_prompts = 2
  b.methods = ('ngram', 'suffix')
  b.temperatures = (0.0,) if args.t0 else (0.0, 1.0)
  b.sizes = (4,)
  b.batch_sizes = (1, 2)
  b.max_prompt_tokens = 24
  b.prompt_bucket = 32
  b.hf_peer = not args.nohf
  b.hf.num_prompts = 1
  b.hf.prompt_lookup_num_tokens = 4
  b.hf.assistant_layers = 1
  return cfg
