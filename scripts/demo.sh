#!/usr/bin/env bash
# The main job: sets up ./.venv if needed, then runs treerl's default job on the CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/treerl bench --scale small "$@"
