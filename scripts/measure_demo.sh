#!/bin/bash
# The demo measurements of docs/RESULTS.md §3 and §7: main-job prompts with DFlash and MTP,
# draft-vs-verify cost, DFlash denoising steps and smaller inference blocks. Each run
# writes docs/measure/<name>.json (scripts/decode.py --metrics_json). Usage:
#   bash scripts/measure_demo.sh [python]
PY=${1:-python}
mkdir -p docs/measure
for p in "humaneval 0" "humaneval 1" "gsm8k_test 0"; do set -- $p
  for d in dflash mtp; do
    $PY scripts/decode.py --config=configs/demo.py:drafter=$d --config.prompt_set=$1 --config.prompt_index=$2 \
      --metrics_json=docs/measure/decode_${d}_$1_$2.json 2>&1 | grep "metrics:"
  done
done
$PY scripts/bench_draft_cost.py --config=configs/demo.py --out=docs/measure/draft_cost_dflash.json 2>&1 | grep "draft/verify"
$PY scripts/bench_draft_cost.py --config=configs/demo.py:drafter=mtp --out=docs/measure/draft_cost_mtp.json 2>&1 | grep "draft/verify"
for p in "humaneval 0" "gsm8k_test 0"; do set -- $p
  for s in 2 4; do
    $PY scripts/decode.py --config=configs/demo.py --config.prompt_set=$1 --config.prompt_index=$2 \
      --config.drafters.dflash.denoise_steps=$s --metrics_json=docs/measure/denoise${s}_$1_$2.json 2>&1 | grep "metrics:"
  done
  for b in 4 8; do
    $PY scripts/decode.py --config=configs/demo.py --config.prompt_set=$1 --config.prompt_index=$2 \
      --config.drafters.dflash.num_draft=$((b - 1)) --metrics_json=docs/measure/block${b}_$1_$2.json 2>&1 | grep "metrics:"
  done
done
