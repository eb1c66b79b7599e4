"""Whole weights from FSDP2 shards (what goes to the rollout engines after each optimizer
step): one ``full_tensor`` per parameter against :func:`full_state_dict`'s buckets.

    torchrun --standalone --nproc-per-node 2 bench/bench_weight_gather.py --shape small          # CPU, gloo
    torchrun --standalone --nproc-per-node 4 bench/bench_weight_gather.py --shape qwen3-1.7b --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from treerl import TreeEngine
from treerl.distributed.data_parallel import full_state_dict, setup, shard
from treerl.models import build_model


def timed(fn, repeats: int, device: torch.device) -> float:
    out = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ctx = setup("nccl" if args.device == "cuda" else "gloo")
    model = build_model("qwen3", args.shape, dtype=args.dtype, device=ctx.device, seed=0)
    engine = TreeEngine(model, "packed")
    shard(engine)
    params = sum(t.numel() for t in model.state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state = model.state_dict()
    rows = {"per-parameter full_tensor": timed(lambda: {k: t.full_tensor() for k, t in state.items()
                                                       if hasattr(t, "full_tensor")}, args.repeats, ctx.device)}
    for mb in (1, 16):
        rows[f"buckets of {mb} MB"] = timed(lambda: full_state_dict(model, bucket_bytes=mb << 20), args.repeats, ctx.device)
    if ctx.is_main:
        print(f"{args.shape} {args.dtype} on {ctx.world_size} x {ctx.device.type}: {params / 1e6:.1f} M parameters, "
              f"{nbytes / 2**20:.0f} MiB, {len(state)} tensors")
        for name, s in rows.items():
            print(f"  {name:<28} {s:8.3f} s  {nbytes / s / 2**30:6.2f} GiB/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"shape": args.shape, "dtype": args.dtype, "world": ctx.world_size, "device": args.device,
                           "bytes": nbytes, "seconds": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
