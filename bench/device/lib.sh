# Sourced by device scripts (from bench/device/next_s18.sh on; the earlier scripts are records of what ran, left as
# they are): the output filter, the GPU's name, the serving wheels (carry [".whl"]) and `show`, a bench_serve run's
# figures.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -d .whl ]; then  # fastapi, uvicorn, openai, prometheus_client: not on the GPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
show() { grep -v "$F" "$1" | grep "in-process\|served\|ratio\|Error\|error\|treerl from" | cut -c1-250; }
# grpo_steps STOP END REPEATS VERSION...: bench_grpo_step.py (0.6B, bf16, defaults) once per VERSION ("base": .v/base's
# src and bench, "new": this tree), none started after STOP s of the script, each ending by END s; JSON under $OUT.
grpo_steps() {
  local stop=$1 end=$2 repeats=$3 v s d; shift 3
  for v in "$@"; do
    s=src; d=.; [ $v = base ] && s=.v/base/src && d=.v/base
    [ $SECONDS -gt $stop ] && break
    PYTHONPATH=$s timeout -k 5 $((end - SECONDS)) python3 $d/bench/bench_grpo_step.py --device cuda --shape qwen3-0.6b \
        --dtype bfloat16 --modes auto --stop-every 0 --repeats $repeats --json $OUT/grpo_step_${v}_$SECONDS.json > /tmp/g.txt 2>&1
    echo "== grpo step $v ($SECONDS s)"; grep -v "$F" /tmp/g.txt | grep "after" | cut -c1-200
  done
}
