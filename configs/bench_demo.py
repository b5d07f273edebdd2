"""Benchmark the demo target (demo/target) with every drafter against AR and transformers.

Commands (after the demo chain of configs/demo_target.py, mtp_demo.py and dflash_demo.py has
produced demo/target, demo/mtp and demo/dflash):
  python scripts/benchmark.py --config=configs/bench_demo.py:quick --out_dir=runs/bench_quick
  python scripts/benchmark.py --config=configs/bench_demo.py:goals --out_dir=runs/bench_goals
  python scripts/benchmark.py --config=configs/bench_demo.py --out_dir=runs/bench_full
  python scripts/benchmark.py --config=configs/bench_demo.py:family --out_dir=runs/bench_family
  python scripts/benchmark.py --render=runs/bench_full   # section for docs/RESULTS.md
Presets: quick (< 10 min on a 2-core CPU: 2 prompts per dataset, 64 new tokens, T in {0, 1},
one size per method, batch 1, one HF prompt), goals (the issue goals' setting: HumanEval
and GSM8K test, 10 prompts each, 128 new tokens, greedy, batch 1, each method at its
trained size, 4 HF prompts; ~15 min) or full (the default, a few hours: 10 prompts
per dataset, 128 new tokens, T in {0, 1}, sizes (num_draft) {4, 8, 16} (DFlash {3, 7, 15}: blocks 4, 8, 16), batch {1, 4}, 4 HF prompts).
Prompts keep their last 256 (quick: 128) tokens, padded to that one width. Datasets:
HumanEval, GSM8K test and Spec-Bench's six groups (data/, or --config.data_dir).
An empty drafters.<m>.path skips that method. Method mtp_vocab: demo/mtp with its drafts
restricted to demo/token_map_2048.json (FastMTP's vocabulary compression; not in a preset).
Every preset runs the default verify length
('auto': the load-aware controller; --config.verify_length=fixed for full-γ verification).
Argument target=DIR: the target checkpoint (default demo/target; the drafters must fit it).

family: issue 19's family table. HumanEval, GSM8K test and the six Spec-Bench groups, 10
prompts each, 128 new tokens, T in {0, 1}, batch {1, 16}; ngram (γ = 7, training-free
reference) and the learned family at their trained sizes (num_draft 0): mtp, eagle3, dflash,
dflash2 (a DFlash-2 checkpoint, loaded by the dflash drafter), dspark from demo/<method>;
a checkpoint directory that does not exist yet is skipped, with the reason in meta.json
and results.md. Drafters run under the default verify length (auto: the load-aware
controller); the per-position conditional acceptance counts only the positions a step
verified, so it is exact under the controller's tiers too.
--config.bench.verify_lengths="('auto','fixed')" adds full-γ verification rows. Draft /
verify cost is timed once per method and batch size. One timed run per batch
(timing_repeats 1), no transformers peer. A few hours on a 2-core CPU.
Expected (family): results.json rows per dataset × T × batch × method with tau,
per_position_acceptance_conditional, speedup, lossless_fraction (1.0 at T=0),
draft_over_verify and tier_steps; results.md with the per-condition family tables; plots
incl. conditional_acceptance_T*_b*.png (one line per method).
Expected (others): results.json / results.md / plots; lossless_fraction 1.0 at T=0; the
peer section compares dspec with transformers generate (AR, prompt lookup, assisted).
"""

from configs import common, common_bench


def get_config(arg=None):
  args = common.parse_arg(arg, quick=False, full=False, goals=False, family=False,
                          target='demo/target')
  cfg = common.decode_config('demo')
  cfg.model.source = 'checkpoint'
  cfg.model.path = args.target
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
  # The MTP restricted to the 2048 tokens the target writes most (scripts/token_map.py):
  # --config.bench.methods="('mtp','mtp_vocab')".
  b.variants.mtp_vocab = {'drafter': 'mtp', 'token_map': 'demo/token_map_2048.json'}
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
  if args.family:
    cfg.timing_repeats = 1
    b.methods = ('ngram', 'mtp', 'eagle3', 'dflash', 'dflash2', 'dspark')
    for method in ('eagle3', 'dspark'):
      cfg.drafters[method].path = f'demo/{method}'
    b.variants.dflash2.path = 'demo/dflash2'
    b.method_sizes = {'ngram': (7,), **{m: (0,) for m in b.methods[1:]}}   # 0: trained size
    b.temperatures = (0.0, 1.0)
    b.batch_sizes = (1, 16)
    b.verify_lengths = ('auto',)
    b.draft_cost_repeats = 10
    b.hf_peer = False
  return cfg
