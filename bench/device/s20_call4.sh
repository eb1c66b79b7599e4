#!/bin/bash
# Session 20 call 4 (what the last ~160 s of device time allow). Call 3's rollout CUDA tests ran out of time before
# their summary. The engine's stream paths on the GPU with reads finished READ_LAG = 2 steps after they start (the
# pinned ring of call 3 is reverted): streams against eager and full forwards, kept buffers with the prefix cache,
# preemption, per-group settings and seeds.
PYTHONPATH=src:tests timeout -k 5 105 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    "tests/cuda/test_rollout_cuda.py::test_cuda_graph_stream_matches_eager_and_full_forward" \
    "tests/cuda/test_rollout_cuda.py::test_cuda_per_group_settings_and_seeds" \
    "tests/cuda/test_rollout_cuda.py::test_cuda_graphs_under_preemption" \
    "tests/cuda/test_rollout_cuda.py::test_cuda_graph_stream_kept_buffers_prefix_cache" > $OUT/cuda_stream.txt 2>&1
grep "passed\|failed\|FAILED\|Error\|assert\|^tests\|%\]" $OUT/cuda_stream.txt | cut -c1-250 | tail -8
echo "done at $SECONDS s"
