#!/bin/bash
# Device call 8 (session 4, issue 24 item 4): the decoder blocks compiled with dynamo's nested_graph_breaks (one graph
# before the tree attention and one after, instead of a cascade of frames): does this torch have the option, do the
# engine's compiled + recomputed CUDA tests pass with it, and the first step cold and warm (target <= 20 s).
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'nested_graph_breaks' in dir(torch._dynamo.config))"
timeout 200 python3 -m pytest -v -m cuda tests/cuda/test_cuda.py -p no:cacheprovider -rfE --tb=short \
    -k "compiled_and_recomputed or flex_float32_matches_per_sequence and auto" 2>&1 \
    | grep "PASSED\|FAILED\|ERROR\|passed\|failed\|Error" | cut -c1-200 | tee $OUT/cuda_nested.log | tail -20
timeout 240 python3 bench/first_step.py --runs cold,warm --out $OUT/first_step_nested_h100.json 2>&1 \
    | grep -v "Warning\|warn" | grep -i "cold\|warm\|first\|graphs\|frames\|compile_inner\|get_fake_value" | head -20
