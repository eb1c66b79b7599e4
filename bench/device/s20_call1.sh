#!/bin/bash
# Session 20 call 1 (~9.5 min, H200). Carry [".whl"].
# Issue 23: session 18's profile had the served step at 5.04 ms wall against 4.47 ms of device time (in process,
# engine thread ~100% of a CPU, cudaEventSynchronize ~1 ms a step under the profiler). Where is the device idle, and
# what is the engine thread doing then? (1) profile_serve_phases (torch profiler) with the new idle attribution.
# Predicted: ~0.5-0.8 ms a step idle, most of it inside admissions (_admit / _load_prompts / _store_prompts: ~7-8 ms
# of host work each, 128 in 600 steps, while one decode step of ~4.5 ms is queued) and LogReader.finish.
# (2) the same window under cProfile: the engine thread's Python hot spots. (3) the CUDA tests session 18 could not
# finish (test_cuda.py, chain attention, overlap) and the copy kernel's bf16 conversion case, 3 processes at once.
source bench/device/lib.sh
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 170 python3 bench/profile_serve_phases.py --skip 800 --window 600 \
    --profile-json $OUT/phases.json $ARGS --modes in-process > $OUT/phases.txt 2>&1
echo "== phases ($SECONDS s)"; grep -v "$F" $OUT/phases.txt | grep "^window\|^device idle\|    idle\|^device in\|^live rows\|in-process  \|phases_ms" | cut -c1-160 | head -50
PYTHONPATH=/tmp/site:src timeout -k 5 150 python3 bench/profile_serve_phases.py --skip 800 --window 600 \
    --cprofile $OUT/cprofile.txt $ARGS --modes in-process > $OUT/cprofile_run.txt 2>&1
echo "== cprofile ($SECONDS s)"; grep "cProfile window\|in-process  " $OUT/cprofile_run.txt | cut -c1-200; head -60 $OUT/cprofile.txt | cut -c1-170
L=$((560 - SECONDS))
T="timeout -k 5 $L python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short"
PYTHONPATH=src:tests $T tests/cuda/test_cuda.py > $OUT/cuda_a.txt 2>&1 &
PYTHONPATH=src:tests $T tests/cuda/test_chain_attention_cuda.py > $OUT/cuda_b.txt 2>&1 &
PYTHONPATH=src:tests $T tests/cuda/test_overlap_cuda.py tests/rollout/test_rollout_kv_copy.py > $OUT/cuda_c.txt 2>&1 &
wait
for f in a b c; do echo "== cuda_$f"; grep "passed\|failed\|FAILED\|ERROR\|assert\|Error" $OUT/cuda_$f.txt | cut -c1-250 | tail -8; done
echo "done at $SECONDS s"
