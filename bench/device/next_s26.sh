#!/bin/bash
# Prepared in session 25 for the next one (~9.5 min, H200 or H100). Carry [".whl"].
# (1) Session 25's open question: the overlapped prompt part at 264 programs ran the pair 2.7 us a layer faster at 64
#     rows (15 at 1,024) in bench/decode_kernels.py, yet bench_rollout measured 264 4-5% slower in one run (call 2) and
#     +0.7% in another (call 4). Here: alternating processes, three each, 528 (the default) and 264 (the prompt part's
#     keyword default patched). Predicted from the kernel bench: 64 rows -0.07 ms a step (+3%), 1,024 rows -0.4 ms (+2.7%).
# (2) Sessions 24-25's decode changes on issue 23's served workload, unmeasured: the served step runs one attention
#     launch a layer (conversations keep their prompts in their own blocks: no overlap there), so predicted unchanged
#     within the spread; in process and served on main.
# (3) If an H100 is lent: bench_rollout's two cases there (issue 25's targets are H100 fractions).
source bench/device/lib.sh
rollout() {  # rollout TARGET: bench_rollout with the overlapped prompt part's programs at least TARGET
  timeout -k 5 100 python3 -c "
import runpy, sys
sys.path.insert(0, 'src')
import treerl.rollout.decode_attention as d
d.split_attention.__kwdefaults__['target'] = int(sys.argv[1])
sys.argv = ['bench/bench_rollout.py'] + sys.argv[2:]
runpy.run_path('bench/bench_rollout.py', run_name='__main__')" $1 --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_target$1_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
}
for t in 528 264 528 264 528 264; do
  [ $SECONDS -gt 300 ] && break
  echo "== rollout, prompt part >= $t programs ($SECONDS s)"; rollout $t
done
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/serve_in_process.json > /tmp/m.txt 2>&1
echo "== in process ($SECONDS s)"; show /tmp/m.txt | grep -v slowest
PYTHONPATH=/tmp/site:src timeout -k 5 $((570 - SECONDS)) python3 bench/bench_serve.py $ARGS --modes served --client-procs 8 --json $OUT/serve_served.json > $OUT/served.txt 2>&1
echo "== served ($SECONDS s)"; show $OUT/served.txt | grep -v slowest
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && [ $SECONDS -lt 500 ]; then
  timeout -k 5 $((585 - SECONDS)) python3 bench/bench_rollout.py --device cuda --cases 0.6b:8x8,0.6b:64x16 --extras "" \
      --bandwidth 3.0e12 --out $OUT/rollout_h100.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED"
fi
