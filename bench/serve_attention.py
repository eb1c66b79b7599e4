"""The serving step's own-part decode attention (``SharedPrefixCache.attend_own_merged``) on the shape
``bench_serve.py --mixed`` runs at steady state: ~44 conversations of 700-2,600 tokens, each
its whole context in its own paged blocks (64 slots), Qwen3-0.6B's 8 KV heads x 128 and 2
queries per KV head, bf16, the prompt part empty. Times (CUDA graph replays, inputs rotated over
4 layers' pools) each way to run it:

- ``merged``: one key range per (row, head), merged in the kernel's epilogue (the default where
  rows x heads >= ``MERGED_MIN_PROGRAMS``), with its tile settings (``{}``: the default);
- ``split``: ``split_attention`` in key ranges for ``target`` programs, then ``merge_ranges``;

and the bandwidth each reaches on the K/V bytes the rows hold (read once; the alone case's 4
layers, ~18 MB, fit the L2 cache: its figure is not DRAM bandwidth). Each result is checked
against float32 attention over the rows' dense keys (bf16: to 1e-2). A case of 64 rows of one
length (a GRPO rollout's own part past 512 keys) is there beside the served ones.

    python bench/serve_attention.py --out $OUT/serve_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton.runtime.errors
import triton.testing

if not any((Path(p) / "treerl").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # (an A/B's PYTHONPATH wins: bench_serve.py)

from treerl.rollout.decode_attention import merge_ranges, split_attention, split_attention_merged  # noqa: E402
from treerl.rollout.types import raw, stored  # noqa: E402

H, M, D, PAGE = 8, 2, 128, 64


def case(rows: int, slots: int, lo: int, hi: int, device: str, dtype: torch.dtype, seed: int = 0):
    """``slots`` group slots, the first ``rows`` live with lengths uniform in [lo, hi]; 4 layers'
    pools (random block order), the queries, the additive mask and the block table."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (rows,), generator=g).tolist() + [0] * (slots - rows)
    span = -(-max(lens) // PAGE) * PAGE
    nblk = span // PAGE
    blocks = slots * nblk + 1
    order = torch.randperm(slots * nblk, generator=g).reshape(slots, nblk)
    mask = torch.full((slots, span), torch.finfo(dtype).min, dtype=dtype)
    for i, n in enumerate(lens):
        mask[i, :n] = 0
    layers = [(torch.randn(slots, H, M, D, dtype=dtype, device=device),
               torch.randn(blocks, H, PAGE, D, dtype=dtype, device=device),
               torch.randn(blocks, H, PAGE, D, dtype=dtype, device=device)) for _ in range(4)]
    return lens, layers, mask.to(device), order.to(device)


def reference(q, pk, pv, mask, table, lens) -> torch.Tensor:
    """float32 attention over each live row's dense keys -> ``[B, 1, H x M, D]``."""
    out = torch.zeros(q.shape[0], 1, H * M, D, device=q.device)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        blk = table[i, : -(-n // PAGE)]
        k = raw(pk)[blk].view(pk.dtype).transpose(0, 1).reshape(H, -1, D)[:, :n].float()
        v = raw(pv)[blk].view(pv.dtype).transpose(0, 1).reshape(H, -1, D)[:, :n].float()
        p = torch.softmax(q[i].float() @ k.transpose(-1, -2) * D ** -0.5, -1)
        out[i, 0] = (p @ v).reshape(H * M, D)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path)
    p.add_argument("--smoke", action="store_true", help="short rows, no timing (on the CPU: TRITON_INTERPRET=1)")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                   help="the pools in the queries' dtype (auto) or float8 e4m3 (RolloutEngine(kv_cache_dtype='fp8'))")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.float32 if args.smoke else torch.bfloat16  # (the interpreter's bf16 dots are not bf16 math)
    # the default (64-key tiles, 4 warps, 2 stages), 64-key tiles' other warps, 128-key tiles' settings (faster here
    # on rows of unequal length, slower on equal ones, no change end to end: session 17 call 3), and key ranges
    variants = [("merged", {})]
    variants += [("merged", dict(block_n=64, num_warps=w, num_stages=s)) for w, s in ((4, 2), (8, 2))]
    variants += [("merged", dict(block_n=128, num_warps=w, num_stages=s)) for w, s in ((4, 1), (4, 2), (8, 1))]
    # key ranges: session 17 made ranges past a row's last key free (they read a tile each before), which favours
    # more, shorter ranges (a balance over rows of unequal length)
    variants += [("split", dict(target=t)) for t in (528, 1056, 2112, 4224)] + [("split", dict(target=528, block_n=128))]
    variants.append(("merged", {}))  # the default again: the spread of one setting
    if args.kv_dtype == "fp8":  # (float8 pools: deeper pipelines, the merged kernel's settings only)
        variants = [("merged", dict(block_n=n, num_warps=w, num_stages=s))
                    for n, w, s in ((64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3))]
    cases = [("serve: 44 live of 64 slots, 700-2600 keys", 44, 64, 700, 2600),
             ("serve: 44 live of 44 slots, 700-2600 keys", 44, 44, 700, 2600),
             ("serve: 20 live of 32 slots, 1500-3000 keys", 20, 32, 1500, 3000),
             ("grpo: 64 rows of 768 keys", 64, 64, 768, 768),
             ("long: 64 rows of 2048 keys", 64, 64, 2048, 2048),
             ("alone: 1 row, 1100 keys", 1, 1, 1100, 1100)]
    if args.smoke:  # (Triton's interpreter: one of each kind, a small case)
        variants, cases = [variants[0], variants[4], variants[8]], [("smoke: 5 live of 8 slots", 5, 8, 700, 2600)]
    rows = []
    for name, live, slots, lo, hi in cases:
        if args.smoke:
            lo, hi = lo // 20, hi // 20
        lens, layers, mask, table = case(live, slots, lo, hi, dev, dt)
        if args.kv_dtype == "fp8":
            layers = [(q, stored(pk, torch.float8_e4m3fn), stored(pv, torch.float8_e4m3fn)) for q, pk, pv in layers]
        nbytes = 2 * sum(-(-n // PAGE) * PAGE for n in lens) * H * D * layers[0][1].element_size()
        o_pre = torch.zeros(slots, H, 1, M, D, device=dev)
        l_pre = torch.full((slots, H, 1, M), float("-inf"), device=dev)
        ref = reference(*layers[0], mask, table, lens)
        for kind, st in variants:
            def run(layer, kind=kind, st=st):
                q, pk, pv = layer
                if kind == "merged":
                    return split_attention_merged(q, pk, pv, mask, D ** -0.5, o_pre, l_pre, 1, dt,
                                                  table=table, **st)
                o, l = split_attention(q, pk, pv, mask, D ** -0.5, table=table, **st)
                return merge_ranges(o, l, o_pre, l_pre, 1, dt)

            try:
                got = run(layers[0])
            except triton.runtime.errors.OutOfResources as e:  # (a tile setting past an SM's shared memory)
                print(f"{name:<44} {kind:6} {str(st):36} out of resources ({e})", flush=True)
                continue
            err = (got.float() - ref)[:live].abs().max().item()  # (empty slots: dead rows, any output)
            assert err <= (1e-4 if dt == torch.float32 else 1e-2), (name, kind, st, err)
            turn = itertools.cycle(layers)
            ms = 1.0 if args.smoke else triton.testing.do_bench_cudagraph(lambda: run(next(turn)), rep=50,
                                                                            return_mode="median")
            r = dict(case=name, kind=kind, setting=st, us=ms * 1e3, tb_s=nbytes / ms / 1e9, err=err)
            rows.append(r)
            print(f"{name:<44} {kind:6} {str(st):36} {r['us']:8.1f} us {r['tb_s']:5.2f} TB/s err {err:.1e}",
                  flush=True)
        if args.out:  # (after each case: a cut run keeps what it measured)
            args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
