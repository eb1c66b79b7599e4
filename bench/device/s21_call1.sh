#!/bin/bash
# (A record: it ran a working tree with a CORES variant of decode_attention._split_kernel and its serve_attention.py
# variants; both were reverted after this call, not committed. The figures: bench/RESULTS.md, session 21.)
# Session 21 call 1 (~9 min, H200). Carry [".whl"]. The decode attention's products on the CUDA cores
# (split kernel, CORES: 2 queries a program as float32 multiply-adds, no tensor-core tile of 16). Session 19 found
# the kernel bound by its work per key tile (float8: half the bytes, the same time). Predicted: bf16 served shapes
# -5..-10% (the kernel at ~90% of the HBM's rate where it was 82%), float8 -30..-45% (bytes, not work, bound it);
# end to end in process (bf16) +2..+5% tokens/s, the probe's p50 ratio -0.05..-0.15.
# (1) serve_attention.py bf16: default, 128-key tiles, ranges; cores over tiles 16/32/64 x warps 2/4/8 x stages 1/2.
# (2) in process, default vs CORES=True (32-key tiles, 4 warps, 2 stages). (3) serve_attention.py float8, the same.
source bench/device/lib.sh
summary() { python3 - "$1" <<'PY'
import json, sys, collections
rows = json.load(open(sys.argv[1])); by = collections.defaultdict(list)
for r in rows: by[r["case"]].append(r)
for case, rs in by.items():
    d = min((r for r in rs if not r["setting"].get("cores")), key=lambda r: r["us"])
    c = min((r for r in rs if r["setting"].get("cores")), key=lambda r: r["us"])
    d0 = [r["us"] for r in rs if r["setting"] == {}]
    print(f"{case[:44]:44} default {d0} best tc {d['kind']} {d['setting']} {d['us']:.1f} us {d['tb_s']:.2f} | "
          f"cores {c['kind']} {c['setting']} {c['us']:.1f} us {c['tb_s']:.2f} TB/s err {c['err']:.1e}")
PY
}
timeout -k 5 200 python3 bench/serve_attention.py --out $OUT/attn_bf16.json > /tmp/attn_bf16.txt 2>&1
echo "== attention bf16 ($SECONDS s)"; grep -i "error\|assert" /tmp/attn_bf16.txt | head -5; summary $OUT/attn_bf16.json
ARGS="--device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 --turns 6 --min-tokens 16 --max-tokens 512 --prefix-cache-tokens 131072"
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 bench/bench_serve.py $ARGS --modes in-process --json $OUT/base.json > $OUT/base_inproc.txt 2>&1
echo "== base in-process ($SECONDS s)"; show $OUT/base_inproc.txt | grep -v slowest
PYTHONPATH=/tmp/site:src timeout -k 5 110 python3 -c "import sys, runpy; import treerl.rollout.decode_attention as d; d.CORES = True; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" \
    bench/bench_serve.py $ARGS --modes in-process --json $OUT/cores.json > $OUT/cores_inproc.txt 2>&1
echo "== cores in-process ($SECONDS s)"; show $OUT/cores_inproc.txt | grep -v slowest
timeout -k 5 $((585 - SECONDS)) python3 bench/serve_attention.py --kv-dtype fp8 --out $OUT/attn_fp8.json > /tmp/attn_fp8.txt 2>&1
echo "== attention fp8 ($SECONDS s)"; grep -i "error\|assert" /tmp/attn_fp8.txt | head -5; summary $OUT/attn_fp8.json
