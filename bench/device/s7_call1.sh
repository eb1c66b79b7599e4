#!/bin/bash
# For the next session with device time (written in session 6, which had none left): measure the two unmeasured decode
# changes of this branch (decode-both-unmeasured = splitk-unmeasured + attn-pair-unmeasured) before any becomes a
# default. Prepare on the dev machine (ignored folders, carried):
#   for b in main splitk-unmeasured attn-pair-unmeasured decode-both-unmeasured; do
#     rm -rf .v/$b && mkdir -p .v/$b && git archive $b src bench tests pyproject.toml | tar -x -C .v/$b; done
# then run  bash bench/device/next_decode_ab.sh 1  (kernels and tests, ~6 min)  and  ... 2  (rollout A/B, ~9 min),
# carry [".v"]. Predicted (session 6, unmeasured): split-K output/down products 0.7-0.9 -> >= 2 TB/s, -0.2 ms a
# step at 64 rows (2.76 -> ~2.55 ms, 46% -> ~50% of the floor); one attention launch -0.05..-0.15 ms.
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
V=.v/decode-both-unmeasured
if [ "$1" = 1 ]; then
  PYTHONPATH=$V/src timeout 240 python3 -m pytest -q -m cuda --rootdir $V -c $V/pyproject.toml $V/tests/cuda/test_rollout_cuda.py -p no:cacheprovider -rfE \
      --tb=short 2>&1 | grep -v "$F" | cut -c1-240 | tail -8
  PYTHONPATH=$V/src timeout 150 python3 $V/bench/decode_gemms.py --sweep --out $OUT/gemms.json 2>&1 | grep -v "$F" > $OUT/gemms.log
  PYTHONPATH=$V/src timeout 120 python3 $V/bench/tune_split_attention.py --pair --out $OUT/pair.json 2>&1 | grep -v "$F" | tail -12
else
  for b in main splitk-unmeasured attn-pair-unmeasured decode-both-unmeasured; do
    PYTHONPATH=.v/$b/src timeout 130 python3 .v/$b/bench/bench_rollout.py --device cuda --extras "" --out $OUT/rollout_$b.json \
        2>&1 | grep -v "$F" | tail -4
  done
fi
