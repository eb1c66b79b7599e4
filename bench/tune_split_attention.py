"""Kernel settings of the split-key decode attention (treerl.rollout.decode_attention) on
the rollout benchmark's shapes (Qwen3-0.6B: 8 KV heads x 128, bf16): time per call and the
bandwidth reached (K/V bytes read once), for each setting; the defaults first.

    python bench/tune_split_attention.py --out $OUT/tune_split.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.rollout.decode_attention import split_attention  # noqa: E402

# (name, entries, queries per entry and head, keys): the prefix and own parts of 64 and 1,024 rows
CASES = [("prefix 8 groups x 16 q", 8, 16, 1024), ("own 64 rows, 256 keys", 64, 2, 256),
         ("prefix 64 groups x 32 q", 64, 32, 1024), ("own 1024 rows, 256 keys", 1024, 2, 256)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    H, D, dt = 8, 128, torch.bfloat16
    settings = [dict()] + [dict(block_n=bn, target=t, num_warps=w, num_stages=st)
                           for bn, t, w, st in itertools.product((64, 128), (528, 1056), (4, 8), (2, 3))]
    rows = []
    for name, B, M, N in CASES:
        q = torch.randn(B, H, M, D, device="cuda", dtype=dt)
        k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(2))
        mask = torch.zeros(B, N, device="cuda", dtype=dt)
        ref_o, ref_l = split_attention(q, k, v, mask, D ** -0.5)
        ref = (torch.softmax(ref_l, 2)[..., None] * ref_o).sum(2)
        bytes_ = 2 * B * H * N * D * 2
        best = None
        for st in settings:
            try:
                o, l = split_attention(q, k, v, mask, D ** -0.5, **st)
                err = ((torch.softmax(l, 2)[..., None] * o).sum(2) - ref).abs().max().item()
                ms = triton.testing.do_bench(lambda: split_attention(q, k, v, mask, D ** -0.5, **st), warmup=25, rep=100,
                                             return_mode="median")
            except Exception as e:  # noqa: BLE001 - a setting the compiler refuses
                rows.append(dict(case=name, setting=st, error=str(e)[:200]))
                continue
            row = dict(case=name, setting=st, ms=ms, tb_s=bytes_ / ms / 1e9, err=err)
            rows.append(row)
            if best is None or ms < best["ms"]:
                best = row
        default = next(r for r in rows if r["case"] == name and r["setting"] == {} and "ms" in r)
        print(f"{name:<26} default {default['ms'] * 1e3:7.1f} us {default['tb_s']:5.2f} TB/s | best "
              f"{best['ms'] * 1e3:7.1f} us {best['tb_s']:5.2f} TB/s {best['setting']} (err {best['err']:.1e})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
