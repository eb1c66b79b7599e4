#!/bin/bash
# The served benchmark's packages the GPU machine lacks (bench_serve.py --modes served: FastAPI, uvicorn, the openai
# client and what they need beyond the machine's anyio, httpx, h11, click, tqdm and prometheus-client), downloaded
# here as wheels into .whl/ (ignored; carry [".whl"]; lib.sh installs them into /tmp/site when .whl/ is there).
# Versions pinned to one set whose requirements the machine's packages meet (openai 1.x: httpx < 1; pydantic 2.11
# and its core built for CPython 3.12). Run from the repository's root: bash bench/device/wheels.sh
set -euo pipefail
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    fastapi==0.115.12 starlette==0.46.2 uvicorn==0.34.3 openai==1.82.1 pydantic==2.11.7 pydantic-core==2.33.2 \
    annotated-types==0.7.0 typing-inspection==0.4.1 distro==1.9.0 jiter==0.10.0 sniffio==1.3.1
ls .whl | wc -l; du -sh .whl
