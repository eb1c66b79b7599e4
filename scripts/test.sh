#!/usr/bin/env bash
# The test command: sets up ./.venv if needed, then runs the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
