#!/bin/bash
# Device call (session 4, issue 24; H100, < 7 min): the chain attention after a prefix, with its calls counted.
# (a) the CUDA tests of tests/cuda/test_chain_attention_cuda.py: each fused kernel against float64 as the engine
#     runs it (cuDNN's calls on lengths padded to multiples of 128, checked call by call), the probe's verdicts
#     (printed), cuDNN passing the probe on sm90, then the bf16 engine with the path on/off (routes printed);
# (b) bench/long_trees.py on long_prefix, then episodes: auto (the path off, the default), auto-chain (on),
#     auto-chainflash (on, flash's kernels only), each row with the timed step's attention layer calls by route
#     (causal / chain:<kernel> / mask / mask:chain-off / mask:no-kernel / kept), the chain kernel shapes so far
#     and the probe's verdicts (results in $OUT/long_trees_s4_chain.json, "chain_probe").
# Each step in its own process under a timeout: a crash or a hang ends that step only.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
F="Warning\|warn\|USDT\|Inductor\|important use\|deprecated\|forward_call\|^\s*$\|pow_by_natural\|split the reduction\|^softmax"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())"
T=tests/cuda/test_chain_attention_cuda.py
timeout -k 5 50 python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider -m cuda $T -k "not engine" 2>&1 \
    | grep -v "$F" | tee $OUT/chain_cuda_kernels.log | tail -25
echo "pytest (kernels, probe) exit: ${PIPESTATUS[0]}"
timeout -k 5 120 python3 -m pytest -q -s -rfEs --tb=short -p no:cacheprovider -m cuda $T -k engine 2>&1 \
    | grep -v "$F" | tee $OUT/chain_cuda_engine.log | tail -15
echo "pytest (engine) exit: ${PIPESTATUS[0]}"
timeout -k 5 225 python3 bench/long_trees.py --sections workloads --workloads long_prefix,episodes \
    --configs auto,auto-chain,auto-chainflash --repeats 2 --max-seconds 180 --out $OUT/long_trees_s4_chain.json 2>&1 \
    | grep -v "$F" | tee $OUT/long_trees_s4_chain.log | tail -30
echo "long_trees exit: ${PIPESTATUS[0]}"
