#!/bin/bash
# Session 38, call 4 (~3 min, H200): does the 1,024-row decode attention keep its rate on part of the SMs (green
# contexts), leaving the rest to the other half's products? bench/device/sm_split_probe.py's docstring has the
# prediction. Then tbo_probe.py once more after its refactor (its 256-key case: the same figures as call 1 expected).
source bench/device/lib.sh
export PYTHONPATH=src:bench/device
python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
timeout -k 5 240 python3 bench/device/sm_split_probe.py --out $OUT/sm_split_s38_call4.json > $OUT/sm_split_s38_call4.log 2>&1
echo "rc $? ($SECONDS s)"; grep -v "$F" $OUT/sm_split_s38_call4.log | cut -c1-1500 | tail -12
timeout -k 5 100 python3 bench/device/tbo_probe.py --cases 64x16:256 > $OUT/tbo_probe_s38_call4.log 2>&1
echo "rc $? ($SECONDS s)"; grep -v "$F" $OUT/tbo_probe_s38_call4.log | cut -c1-900 | tail -4
