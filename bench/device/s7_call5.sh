#!/bin/bash
# Session 7, device call 5: bench_serve --mixed --probe in process, new kernel then old (.v/main), same call
# (carry [".v", ".whl"]).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
cp bench/bench_serve.py .v/main/bench/bench_serve.py
for b in new old; do
  s=src; d=.; [ $b = old ] && s=.v/main/src && d=.v/main
  PYTHONPATH=/tmp/site:$s timeout 230 python3 $d/bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe \
    --repeats 1 --min-tokens 16 --max-tokens 512 --modes in-process --json $OUT/serve_$b.json 2>&1 | grep -v "$F" | tee $OUT/serve_$b.log | tail -6
done
