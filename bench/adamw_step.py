"""One optimizer step of AdamW on a model's parameters (gradient clipping included, as
``Learner.optimizer_step`` runs it): torch's default implementation (``foreach`` on CUDA)
against ``fused=True``, in milliseconds (CUDA events over repeated steps).

    python bench/adamw_step.py --shapes qwen3-0.6b,qwen3-1.7b --out $OUT/adamw.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.models import build_model  # noqa: E402


def step_ms(model, fused: bool, repeats: int) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-6, betas=(0.9, 0.95), fused=fused or None)

    def one():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    for _ in range(3):
        one()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        one()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = {}
    for shape in args.shapes.split(","):
        model = build_model("qwen3", shape, dtype=args.dtype, device="cuda", seed=0)
        for fused in (False, True):
            rows[f"{shape}/{'fused' if fused else 'default'}"] = ms = step_ms(model, fused, args.repeats)
            print(f"{shape} {args.dtype} AdamW {'fused' if fused else 'default (foreach)'}: {ms:.2f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
