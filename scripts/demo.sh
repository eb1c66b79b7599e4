#!/usr/bin/env bash
# The main job: sets up ./.venv if needed, then the built-in demo on the CPU — a tiny model
# learns to sort digits (SFT warm-up, then GRPO through the tree engine) — and evaluates
# the checkpoint it wrote. Extra arguments are config overrides, e.g. train.steps=10.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/treerl train examples/demo_sorting.yaml "$@" --overwrite   # each run of the demo starts over
.venv/bin/treerl eval runs/demo -n 200
