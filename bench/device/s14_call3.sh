#!/bin/bash
# Session 14 call 3 (nvidia-h200): issue 23's serving period. Call 2's profile: a decode step's period 4.99 ms, of
# which device time 2.96 (decode) + 1.55 (admissions: ~9.7 ms each) + 0.13 (95 compactions) + 0.12 (sampling): the
# device is ~95% busy. (1) compactions only after the smaller bucket held for COMPACT_AFTER steps (new) against main
# 7d99253 (.v/base), prefix cache 65,536 tokens (bench default); (2) the new code with a prefix cache of 131,072 (the
# running batch's K/V slots) and 262,144 tokens: the 65,536 cache misses whole conversations (269k prompt tokens
# computed where the agents' new tokens are ~140k); (3) the admissions' device time by sub-phase (300-step window).
# carry [".whl", ".v"].
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
for v in new:65536 base:65536 new:131072; do
  s=src; [ ${v%%:*} = base ] && s=.v/base/src
  PYTHONPATH=/tmp/site:$s timeout -k 5 120 python3 bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
      --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --modes in-process \
      --prefix-cache-tokens ${v##*:} --json $OUT/serve_${v%%:*}_${v##*:}.json > $OUT/serve_${v%%:*}_${v##*:}.txt 2>&1
  echo "== $v"; grep -v "$F" $OUT/serve_${v%%:*}_${v##*:}.txt | grep "in-process\|alone" | cut -c1-250
done
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/profile_serve_phases.py --window 200 --profile-json \
    $OUT/serve_phases.json --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 \
    --min-tokens 16 --max-tokens 512 --modes in-process > $OUT/serve_phases.txt 2>&1
grep -v "$F" $OUT/serve_phases.txt | grep -v "top_host\|top_kern" | grep -B2 -A14 "^window" | cut -c1-180 | head -30
grep "small prefills" $OUT/serve_phases.txt | tail -1
