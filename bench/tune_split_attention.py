"""Kernel settings of the split-key decode attention (treerl.rollout.decode_attention) on
the rollout benchmark's shapes (Qwen3-0.6B: 8 KV heads x 128, bf16): time per call (CUDA graph
replays, inputs rotated over 4 copies) and the bandwidth reached (K/V bytes read once), for each
setting; the defaults first and last.

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
# and a serving step (bench_serve.py --mixed: ~42 agents' rows of ~1.2k tokens, each its own prompt: groups of 1)
CASES = [("prefix 8 groups x 16 q", 8, 16, 1024), ("own 64 rows, 256 keys", 64, 2, 256),
         ("prefix 64 groups x 32 q", 64, 32, 1024), ("own 1024 rows, 256 keys", 1024, 2, 256),
         ("serve: prompts 42 x 2 q", 42, 2, 1024), ("serve: own 42 rows", 42, 2, 256)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path)
    p.add_argument("--defaults-only", action="store_true", help="time the default setting alone (a baseline)")
    p.add_argument("--cases", default="", help="comma-separated substrings: only the cases whose name holds one")
    p.add_argument("--wide", action="store_true", help="a wider grid (warps 2-4, 1-3 stages, key tiles 32-128)")
    args = p.parse_args()
    H, D, dt = 8, 128, torch.bfloat16
    settings = [dict()]  # the defaults first
    if args.wide:
        settings += [dict(block_n=bn, target=t, num_warps=w, num_stages=st) for bn, t, w, st in
                     itertools.product((32, 64, 128), (264, 528, 1056, 2112), (2, 4), (1, 2, 3))]
    elif not args.defaults_only:
        settings += [dict(block_n=bn, target=t, num_warps=4, num_stages=st)
                     for bn, t, st in itertools.product((64, 128), (264, 528, 1056), (2, 3, 4))]
        settings += [dict(block_n=64, target=t, num_warps=8, num_stages=3) for t in (264, 528)]
    settings.append(dict())  # the defaults again, last: the spread between two timings of one setting
    cases = [c for c in CASES if not args.cases or any(w in c[0] for w in args.cases.split(","))]
    rows = []
    for name, B, M, N in cases:
        # 4 copies of the inputs, called in turn (K/V of 4 layers: not held in L2 between calls, as in a step),
        # timed as CUDA graph replays (a step replays its graph: no host launch cost)
        copies = [(torch.randn(B, H, M, D, device="cuda", dtype=dt),
                   *(torch.randn(B, H, N, D, device="cuda", dtype=dt) for _ in range(2))) for _ in range(4)]
        mask = torch.zeros(B, N, device="cuda", dtype=dt)
        q, k, v = copies[0]
        ref_o, ref_l = split_attention(q, k, v, mask, D ** -0.5)
        ref = (torch.softmax(ref_l, 2)[..., None] * ref_o).sum(2)
        bytes_ = 2 * B * H * N * D * 2
        best = None
        for st in settings:
            turn = itertools.cycle(copies)
            try:
                o, l = split_attention(q, k, v, mask, D ** -0.5, **st)
                err = ((torch.softmax(l, 2)[..., None] * o).sum(2) - ref).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(lambda: split_attention(*next(turn), mask, D ** -0.5, **st),
                                                       rep=50, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a setting the compiler refuses
                rows.append(dict(case=name, setting=st, error=str(e)[:200]))
                continue
            row = dict(case=name, setting=st, ms=ms, tb_s=bytes_ / ms / 1e9, err=err)
            rows.append(row)
            if best is None or ms < best["ms"]:
                best = row
        first, last = [r for r in rows if r["case"] == name and r["setting"] == {} and "ms" in r][:2]
        default = min(first, last, key=lambda r: r["ms"])
        print(f"{name:<26} default {first['ms'] * 1e3:7.1f} / {last['ms'] * 1e3:7.1f} us {default['tb_s']:5.2f} TB/s | best "
              f"{best['ms'] * 1e3:7.1f} us {best['tb_s']:5.2f} TB/s {best['setting']} (err {best['err']:.1e})", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
