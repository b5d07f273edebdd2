#!/bin/bash
# Main-job prompts with DFlash and MTP, draft-vs-verify cost, DFlash denoising steps and
# smaller inference blocks (the first demo's measurements; docs/RESULTS.md's history). Each
# run writes runs/measure/<name>.json (scripts/decode.py --metrics_json). Usage:
#   bash scripts/measure_demo.sh [python]
PY=${1:-python}
mkdir -p runs/measure
for p in "humaneval 0" "humaneval 1" "gsm8k_test 0"; do set -- $p
  for d in dflash mtp; do
    $PY scripts/decode.py --config=configs/demo.py:drafter=$d --config.prompt_set=$1 --config.prompt_index=$2 \
      --metrics_json=runs/measure/decode_${d}_$1_$2.json 2>&1 | grep "metrics:"
  done
done
$PY scripts/bench_draft_cost.py --config=configs/demo.py --out=runs/measure/draft_cost_dflash.json 2>&1 | grep "draft/verify"
$PY scripts/bench_draft_cost.py --config=configs/demo.py:drafter=mtp --out=runs/measure/draft_cost_mtp.json 2>&1 | grep "draft/verify"
for p in "humaneval 0" "gsm8k_test 0"; do set -- $p
  for s in 2 4; do
    $PY scripts/decode.py --config=configs/demo.py --config.prompt_set=$1 --config.prompt_index=$2 \
      --config.drafters.dflash.denoise_steps=$s --metrics_json=runs/measure/denoise${s}_$1_$2.json 2>&1 | grep "metrics:"
  done
  for b in 4 8; do
    $PY scripts/decode.py --config=configs/demo.py --config.prompt_set=$1 --config.prompt_index=$2 \
      --config.drafters.dflash.num_draft=$((b - 1)) --metrics_json=runs/measure/block${b}_$1_$2.json 2>&1 | grep "metrics:"
  done
done
