#!/bin/bash
# Session 19 call 4 (~3.5 min, H200). Carry [".whl"].
# Call 3: float8 pools take the merged kernel as long as bf16 pools (103 vs 102 us on the serving shape: 1.6 TB/s on
# the float8 bytes): the kernel is bound by its work per key tile, not by the bytes. The products run with the 2
# real queries of a KV head padded to 16 rows; the keys, widened in registers, go through shared memory to be the
# second operand. Tried here: the keys as the products' first operand (`swap` 1: the scores' product; 2: both),
# 64- and 128-key tiles, bf16 and float8 pools. Predicted: if the widened tiles' trip through shared memory is the
# cost, float8 with swap reaches <= 0.6x bf16's time; bf16 itself may gain a little.
source bench/device/lib.sh
for kv in fp8 auto; do
  PYTHONPATH=src timeout -k 5 150 python3 bench/serve_attention.py --kv-dtype $kv --out $OUT/serve_attention_$kv.json \
      > $OUT/serve_attention_$kv.txt 2>&1
  echo "== $kv ($SECONDS s)"; grep -v "$F" $OUT/serve_attention_$kv.txt | grep " us \|Error\|resources\|assert" | grep -v "split \|num_warps" | cut -c1-120
done
