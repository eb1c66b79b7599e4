"""A prefill window's attention, one layer of Qwen3-0.6B (16 query heads over 8 KV heads x 128, bf16):
``rollout_attention`` (SDPA under the dense prefill mask, the keys repeated per query head: CUDA's
memory-efficient kernel) against ``window_attention`` (the split kernel's causal variant + the merge
of its key ranges), on the serving engine's small-prefill buckets (``rows x window x slots``, powers
of two: a conversation's next turn over its cached context) and a GRPO rollout's prompt prefill
(8 prompts of 1,024 tokens). Times are CUDA-graph replays (median); each result is checked against
float32 attention on the real queries.

    python bench/prefill_attention.py --out $OUT/prefill_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

if not any((Path(p) / "treerl").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.rollout.kv import rollout_attention  # noqa: E402
from treerl.rollout.prefill import prefill_mask  # noqa: E402
from treerl.rollout.window_attention import window_attention  # noqa: E402

HQ, H, D = 16, 8, 128


class _Attn(torch.nn.Module):  # (rollout_attention's module argument: read only for a decode step's prefix)
    layer_idx = 0


def case(rows: int, live: list[tuple[int, int]], window: int, slots: int, dtype=torch.bfloat16):
    """``live``: (context, new tokens) of the real rows (the rest: padding rows) -> q, k, v, mask, real."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, HQ, window, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(rows, H, slots, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(rows, H, slots, D, device="cuda", dtype=dtype, generator=g)
    first = [slots - n for n, _ in live] + [slots] * (rows - len(live))
    new = [slots - t for _, t in live] + [slots] * (rows - len(live))
    pad = torch.arange(slots - window, slots, device="cuda")[None, :] < torch.tensor(new, device="cuda")[:, None]
    mask, _ = prefill_mask(torch.tensor(first, device="cuda")[:, None], pad, slots - window, slots, dtype)
    return q, k, v, mask, ~pad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cases = [("serve: 1 turn of 33 over 2,400 (bucket 1 x 64 x 4096)", 1, [(2433, 33)], 64, 4096),
             ("serve: 1 turn of 77 over 1,500 (bucket 1 x 128 x 2048)", 1, [(1577, 77)], 128, 2048),
             ("serve: 2 turns of 60/90 over 1-2k (bucket 2 x 128 x 2048)", 2, [(1160, 60), (2000, 90)], 128, 2048),
             ("serve: 3 turns of 20-200 over 0.6-3k (bucket 4 x 256 x 4096)", 4,
              [(700, 20), (3100, 200), (1800, 120)], 256, 4096),
             ("serve: a first turn of 300 (bucket 1 x 512 x 512)", 1, [(300, 300)], 512, 512),
             ("grpo: 8 prompts of 1,024 (one forward)", 8, [(1024, 1024)] * 8, 1024, 1025)]
    rows = []
    for name, R, live, W, C in cases:
        q, k, v, mask, real = case(R, live, W, C)
        s = q.float() @ k.float().repeat_interleave(HQ // H, 1).transpose(-1, -2) * D ** -0.5 + mask.float()
        ref = (torch.softmax(s, -1) @ v.float().repeat_interleave(HQ // H, 1)).transpose(1, 2)
        ways = {"sdpa": lambda: rollout_attention(_Attn(), q, k, v, mask, D ** -0.5)[0],
                "window": lambda: window_attention(q, k, v, mask, D ** -0.5)}
        for t in (66, 132, 528):  # (session 17 call 3: 264, the default since, was faster or equal to 528 on all)
            ways[f"w{t}"] = lambda t=t: window_attention(q, k, v, mask, D ** -0.5, target=t)
        for way, run in ways.items():
            err = (run().float() - ref)[real].abs().max().item()
            assert err <= 2e-2, (name, way, err)
            ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
            rows.append(dict(case=name, way=way, us=ms * 1e3, err=err))
            print(f"{name:<62} {way:7} {ms * 1e3:8.1f} us  err {err:.1e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
