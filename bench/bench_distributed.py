"""Data-parallel forward+backward over N GPUs (FSDP2, launched by torchrun): per-rank time,
imbalance (max/mean rank time) and scaling efficiency, for the tree-aware partition
(treerl.distributed.partitioner) against equal-token assignment, on the same global batch.

    torchrun --nproc-per-node 2 bench/bench_distributed.py --shape qwen3-1.7b --dtype bfloat16
    torchrun --nproc-per-node 1 ...      # the 1-GPU reference for scaling efficiency
    torchrun --nproc-per-node 2 bench/bench_distributed.py --scale tiny     # CPU, gloo

Scaling efficiency = T(1 GPU) / (N x T(N GPUs)), with T(1 GPU) from --single-json (a 1-rank
run of this script) or measured here by rank 0 on the whole batch before the N-rank runs.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import treerl
from treerl.devtools.benchmark import weighted_logprob_loss
from treerl.distributed import equal_token_partition, partition
from treerl.distributed.data_parallel import gradient_step, setup, shard
from treerl.models import build_model
from treerl.devtools.workloads import SCALES, make_workload


def timed_step(engine, seqs, mine, loss_fn, device):
    """This rank's seconds: (compute incl. the parameter all-gather, the whole step incl. the
    gradient reduce, the all-gather alone)."""
    global_index = torch.tensor(mine, dtype=torch.long)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    with gradient_step(engine):
        sync()
        gathered = time.perf_counter() - t0
        if mine:
            engine.forward_backward([seqs[i] for i in mine],
                                    lambda lps, index: loss_fn(lps, index=global_index[index]), separable=True)
        sync()
        compute = time.perf_counter() - t0
    sync()
    return compute, time.perf_counter() - t0, gathered


def profile_step(engine, seqs, mine, loss_fn, device, path):
    """One step under torch.profiler: the top operators by device time, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed_step(engine, seqs, mine, loss_fn, device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40))
        f.write("\n\nby CPU time\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--scale", default="paper")
    p.add_argument("--workloads", default="grpo,agentic")
    p.add_argument("--mode", default="auto")
    p.add_argument("--max-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--profile", help="rank 0 writes a torch.profiler table of one step here")
    args = p.parse_args()
    ctx = setup()
    torch.manual_seed(0)
    model = build_model("qwen3", args.shape, dtype=args.dtype, device=ctx.device, seed=0)
    engine = treerl.TreeEngine(model, args.mode, max_tokens=args.max_tokens)
    shard(engine, reduce_dtype=torch.float32 if args.dtype == "bfloat16" else None)
    rows = []
    for workload in args.workloads.split(","):
        seqs = [list(map(int, s)) for s in make_workload(workload, SCALES[args.scale], model.config.vocab_size)]
        tree = treerl.PrefixTree.from_sequences(seqs)
        loss_fn = weighted_logprob_loss(tree)
        plans = {"tree-aware": partition(tree, ctx.world_size).ranks,
                 "equal-tokens": equal_token_partition(tree, ctx.world_size, how="greedy").ranks}
        for name, ranks in plans.items():
            mine = ranks[ctx.rank]
            timed_step(engine, seqs, mine, loss_fn, ctx.device)  # warm-up (compile)
            times = [timed_step(engine, seqs, mine, loss_fn, ctx.device) for _ in range(args.repeats)]
            compute = statistics.median(t[0] for t in times)
            step = statistics.median(t[1] for t in times)
            gather = statistics.median(t[2] for t in times)
            if args.profile and ctx.is_main and name == "tree-aware":
                profile_step(engine, seqs, mine, loss_fn, ctx.device, f"{args.profile}.{workload}.txt")
            elif args.profile and name == "tree-aware":
                timed_step(engine, seqs, mine, loss_fn, ctx.device)
            mine_t = torch.tensor([compute], dtype=torch.float64, device=ctx.device)
            all_t = [torch.zeros_like(mine_t) for _ in range(ctx.world_size)]
            dist.all_gather(all_t, mine_t)
            per_rank = [float(t) for t in all_t]
            mine_tokens = torch.tensor([sum(len(seqs[i]) for i in mine)], device=ctx.device)
            all_tok = [torch.zeros_like(mine_tokens) for _ in range(ctx.world_size)]
            dist.all_gather(all_tok, mine_tokens)
            rows.append({"workload": workload, "assignment": name, "ranks": ctx.world_size,
                         "rank_seconds": per_rank, "step_seconds": step,
                         "rank0_gather_seconds": gather, "rank0_reduce_seconds": step - compute,
                         "imbalance": max(per_rank) / statistics.mean(per_rank),
                         "rank_flat_tokens": [int(t) for t in all_tok]})
    if ctx.is_main:
        device = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "CPU (gloo)"
        print(f"\n{args.shape} {args.dtype}, mode {args.mode}, {ctx.world_size} rank(s) on {device}")
        print(f"{'workload':8} {'assignment':12} {'step s':>7} {'gather s':>8} {'reduce s':>8} {'imbalance':>9}"
              "  per-rank compute seconds")
        for r in rows:
            print(f"{r['workload']:8} {r['assignment']:12} {r['step_seconds']:7.3f} {r['rank0_gather_seconds']:8.3f} "
                  f"{r['rank0_reduce_seconds']:8.3f} {r['imbalance']:9.3f}  "
                  + " ".join(f"{t:.3f}" for t in r["rank_seconds"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "args": vars(args), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
