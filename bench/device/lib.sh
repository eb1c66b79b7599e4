# Sourced by device scripts (from bench/device/next_s18.sh on; the earlier scripts are records of what ran, left as
# they are): the output filter, the GPU's name, the serving wheels (carry [".whl"]) and `show`, a bench_serve run's
# figures; `grpo_steps`, `serve` and `rollout` (below) run the benchmarks on main (.v/base) or this tree; `gpu_tests`, a pytest selection.
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -d .whl ]; then  # fastapi, uvicorn, openai and their needs: not on the GPU machine (bench/device/wheels.sh)
  rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
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
# serve VERSION MODE LIMIT: bench_serve.py on issue 23's workload (64 agents x 6 turns, max_tokens 16-512, Qwen3-0.6B
# bf16, prefix cache 131,072, the short request's probe; served: 8 client processes), VERSION "base" (.v/base) or "new",
# MODE in-process or served, LIMIT s; JSON and the whole output under $OUT, its figures printed.
serve() {
  local d=.; [ $1 = base ] && d=.v/base
  PYTHONPATH=/tmp/site:$d/src timeout -k 5 $3 python3 $d/bench/bench_serve.py --device cuda --shape qwen3-0.6b \
      --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 \
      --prefix-cache-tokens 131072 --modes $2 --client-procs 8 --json $OUT/serve_$1_$2_$SECONDS.json > $OUT/serve_$1_$2.txt 2>&1
  echo "== $1 $2 ($SECONDS s)"; show $OUT/serve_$1_$2.txt | grep -v slowest
}
# rollout VERSION: bench_rollout.py's 64 rows (0.6B, 8 x 8, prompt 1,024, 512 new tokens, defaults), "base" or "new".
rollout() {
  local d=.; [ $1 = base ] && d=.v/base
  PYTHONPATH=$d/src timeout -k 5 90 python3 $d/bench/bench_rollout.py --device cuda --cases 0.6b:8x8 --extras "" \
      --bandwidth 4.277e12 --out $OUT/rollout_$1_$SECONDS.json 2>&1 | grep -v "$F" | grep "^0.6b\|FAILED\|Error" | cut -c1-200
}
# gpu_tests LIMIT FILTER FILE...: pytest on the device (-k FILTER) within LIMIT s, output under $OUT, its summary printed.
gpu_tests() {
  local limit=$1 filter=$2; shift 2
  echo "== tests ($SECONDS s)"
  timeout -k 5 $limit python3 -m pytest -q -p no:cacheprovider "$@" -k "$filter" > $OUT/tests.txt 2>&1
  grep "^E \|passed\|failed\|^FAILED" $OUT/tests.txt | head -20 | cut -c1-250
}
# patched LIMIT PROGRAMS SCRIPT ARGS...: a Python SCRIPT within LIMIT s with the kernel step's prompt part at PROGRAMS
# (blocks.PROMPT_PROGRAMS; "default": as the tree has it), printing the prompt part's key ranges each capture ran, so
# a patch that does not take is seen (session 25's did not); PYTHONPATH as the caller sets it.
patched() {
  local limit=$1 t=$2 script=$3; shift 3
  timeout -k 5 $limit python3 -c "
import atexit, runpy, sys
argv = sys.argv[:]
import treerl.rollout.blocks as b, treerl.rollout.shared as sh
if argv[1] != 'default':
    b.PROMPT_PROGRAMS = int(argv[1])
seen, inner = set(), sh.split_attention
def spy(q, *a, **k):
    out = inner(q, *a, **k)
    if k.get('trigger'):
        seen.add((tuple(q.shape), out[0].shape[2]))
    return out
sh.split_attention = spy
atexit.register(lambda: print('prompt part (q shape, ranges):', sorted(seen)))
sys.argv = [argv[2]] + argv[3:]
runpy.run_path(argv[2], run_name='__main__')" $t $script "$@"
}
# with_module LIMIT MODULE "NAME=VALUE ..." SCRIPT ARGS...: a Python SCRIPT within LIMIT s with MODULE's settings
# patched (each NAME one of its constants read at call time, VALUE a Python literal; "" patches nothing), printing its
# constants as run (every upper-case int, float, bool or str); PYTHONPATH as the caller sets it.
with_module() {
  local limit=$1 module=$2 sets=$3 script=$4; shift 4
  timeout -k 5 $limit python3 -c "
import ast, importlib, runpy, sys
argv = sys.argv[:]
m = importlib.import_module(argv[1])
for kv in argv[2].split():
    name, value = kv.split('=')
    assert hasattr(m, name), name
    setattr(m, name, ast.literal_eval(value))
print(argv[1], 'settings:', {k: v for k, v in vars(m).items() if k.isupper() and type(v) in (int, float, bool, str)})
sys.argv = [argv[3]] + argv[4:]
runpy.run_path(argv[3], run_name='__main__')" $module "$sets" $script "$@"
}
# with_blocks LIMIT "NAME=VALUE ..." SCRIPT ARGS...: with_module on treerl.rollout.blocks.
with_blocks() { local limit=$1; shift; with_module $limit treerl.rollout.blocks "$@"; }
