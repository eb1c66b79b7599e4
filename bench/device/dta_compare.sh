#!/bin/bash
# Device call (issue 24): treerl auto/dfs against the DTA authors' engine on the six shapes, in one process,
# with the gradient check. Needs .dta/ (scripts/get_dta.sh on the CPU machine; the run tool's carry: [".dta"]).
# Extra arguments go to bench/dta_compare.py (e.g. --shapes long_prefix,episodes --no-grad-check).
export PYTHONPATH=src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
ls .dta/tree_training_engine.py || { echo ".dta/ did not travel: carry it (run tool: carry ['.dta'])"; exit 2; }
timeout 560 python3 bench/dta_compare.py --max-seconds "${MAX_S:-400}" --out "$OUT/dta_compare_h100.json" "$@" 2>&1 \
    | grep -v "$F" | tee "$OUT/dta_compare_h100.log" | tail -45
