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
