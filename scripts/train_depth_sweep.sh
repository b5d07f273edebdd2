#!/usr/bin/env bash
# The DFlash depth sweep (configs/dflash_demo.py:deep): one drafter per depth, each pinned to
# one core and niced, resuming from its workdir checkpoint, else from a committed export
# (demo/train_state/dflash_l<N>: bf16 params + train_step; fresh AdamW moments). Finished
# depths ship as drafters instead: demo/dflash_l1 (1 layer) and demo/dflash (4 layers).
# Usage: [NICE=n] bash scripts/train_depth_sweep.sh CORE LAYERS [MINUTES]   e.g. 0 4 150
# (niceness 10 by default; SIGTERM stops a run at a step, checkpointed and exported).
set -euo pipefail
core=$1 layers=$2 minutes=${3:-0}
resume=demo/train_state/dflash_l${layers}
args=()
if [ ! -d "runs/dflash_l${layers}/checkpoints" ] && [ -d "$resume" ]; then
  args+=(--config.training.init_from="$resume" --config.training.continue_from_init=True)
fi
exec nice -n "${NICE:-10}" taskset -c "$core" python scripts/train.py \
  --config="configs/dflash_demo.py:deep,layers=${layers},minutes=${minutes}" \
  --workdir="runs/dflash_l${layers}" "${args[@]}"
