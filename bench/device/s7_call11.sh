#!/bin/bash
# Session 7, device call 11 (issue 24): with balanced packs at the 25% default, grpo, agentic and episodes (one timed step
# each, the last 162 s of device time).
export PYTHONPATH=src PYTHONUNBUFFERED=1; timeout -k 5 200 python3 bench/long_trees.py --sections workloads --workloads grpo,agentic,episodes --configs auto --repeats 1 --max-seconds 170 --out $OUT/long_trees_s7_balanced.json 2>&1 | grep "^|" | tail -8
