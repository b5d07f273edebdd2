"""The `bench` section shared by benchmark configs (`scripts/benchmark.py`).

A benchmark config is a decode config (docs/DESIGN.md fields, drafter sub-configs) plus `bench`:
what to sweep and whether to time the `transformers` peer. The top-level decode fields
(`max_new_tokens`, `top_p`, `seed`, `timing_repeats`, `data_dir`, `drafters.*`) apply to
every run of the sweep; `temperature`, `batch_size`, `drafter` and each method's size knob
(`num_draft`) are set by the sweep. `verify_length` applies unless `bench.verify_lengths`
lists the ones to sweep.
"""

import ml_collections

# Spec-Bench's six groups (speed.py names); `spec_bench/mt_bench` is its 8 MT-Bench categories.
SPEC_BENCH_GROUPS = ('mt_bench', 'translation', 'summarization', 'qa', 'math_reasoning', 'rag')
ALL_DATASETS = ('humaneval', 'gsm8k_test') + tuple(f'spec_bench/{g}' for g in SPEC_BENCH_GROUPS)


def bench_section() -> ml_collections.ConfigDict:
  """Defaults of the sweep; configs override what they need."""
  return ml_collections.ConfigDict({
      'datasets': ALL_DATASETS,
      'num_prompts': 8,            # first N prompts of each dataset (fixed order)
      'methods': ('ngram', 'suffix', 'mtp', 'dflash'),   # AR always runs as the baseline
      'temperatures': (0.0, 1.0),
      'sizes': (4, 8, 16),         # draft lengths: each sets drafters.<method>.num_draft
      # Per-method sizes replacing `sizes` (e.g. MTP is limited to its trained depth); a
      # variant without its own entry takes its drafter's.
      'method_sizes': ml_collections.ConfigDict({'mtp': (3,), 'dflash': (3, 7, 15)}),
      'batch_sizes': (1,),
      # Verify lengths to run every method with: () = the config's verify_length ('auto':
      # the load-aware controller, the default; 'fixed': every step verifies num_draft).
      'verify_lengths': (),
      # Bench methods that are registry drafters with other sub-config values: name ->
      # {'drafter': registry name, <drafters.<drafter> key>: value}.
      'variants': ml_collections.ConfigDict({
          'dflash2': {'drafter': 'dflash', 'path': ''},   # DFlash-2 loads as dflash
      }),
      'draft_cost_repeats': 0,     # > 0: time draft vs verify passes once per method × batch
      'max_prompt_tokens': 0,      # > 0: keep only the last N prompt tokens
      'prompt_bucket': 64,         # pad prompt widths to a multiple (fewer recompiles)
      'hf_peer': True,             # time transformers generate on the same prompts
      'hf': ml_collections.ConfigDict({
          'dataset': 'humaneval',  # must be in `datasets`; T=0 and batch 1 must be swept
          'num_prompts': 4,        # first N prompts of that dataset (<= num_prompts)
          'prompt_lookup_num_tokens': 10,
          'max_matching_ngram_size': 2,
          'assistant_layers': 2,   # assistant = the target truncated to its first N layers
          'num_assistant_tokens': 20,             # HF's defaults
          'num_assistant_tokens_schedule': 'constant',
          'assistant_confidence_threshold': 0.4,
          'torch_threads': 0,      # 0: the fastest of 1..cpu_count (hf_peer.pick_torch_threads)
      }),
  })
