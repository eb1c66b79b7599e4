"""Asynchronous vs synchronous RL: wall-clock time to train the same number of samples on
a workload with long-tailed generation lengths (``treerl.devtools.longtail``: Pareto
lengths, most completions short, a few up to ``--max-tokens``), same model, task and
hardware.

    python bench/bench_async.py                      # CPU processes (tiny model)
    python bench/bench_async.py --device cuda        # trainer on cuda:0, worker on cuda:1,
                                                     # NCCL weight broadcast, qwen3-0.6b bf16

Synchronous: ``Trainer.step()`` (generate, then train) in one process (CPU: with 1 thread
and with as many threads as the async run has processes; the faster is the baseline). Asynchronous: ``AsyncRunner`` with worker
processes, for each ``--etas`` value. The clock starts once the workers have built their
models (start-up excluded on both sides) and stops when the trainer has taken ``--steps``
steps. The table also shows where the time went: the trainer's busy fraction (training
+ publishing) and the workers' generation fraction; the one near 1.0 is the limit.

    python bench/bench_async.py --rollout-only       # generation side only, one process

``--rollout-only`` measures what streaming does for the rollout worker, without training
(fits a CPU): the same ``--steps`` x ``--prompts`` groups generated (a) one ``generate`` per
step (each step waits for its longest row), (b) one stream that always has ``(eta + 1) x
--prompts`` groups admitted or waiting, as a streaming async worker does (eta = the first
``--etas`` value). Weights stay fixed. (The wave decoder that used to be row (a) is gone:
``generate`` is continuous batching too.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from treerl.async_rl import AsyncOptions, AsyncRunner
from treerl.devtools.longtail import register
from treerl.config import Config
from treerl.models import SHAPES
from treerl.trainer import Trainer

DEFAULTS = {
    "cpu": dict(shape="tiny", dtype="float32", prompts=16, group=8, max_tokens=256, min_tokens=8, steps=12, vocab=4096),
    "cuda": dict(shape="qwen3-0.6b", dtype="bfloat16", prompts=16, group=8, max_tokens=512, min_tokens=16, steps=10,
                 vocab=None),  # None: the shape's own vocabulary (151936 for qwen3-0.6b)
}


def make_config(args, device: str, eta: int = 0) -> Config:
    overrides = {} if args.vocab is None else {"vocab_size": args.vocab}
    task = {"max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "alpha": args.alpha}
    return Config.from_yaml(None, [
        "task.name=longtail", f"task.kwargs={json.dumps(task)}", f"model.shape={args.shape}",
        f"model.dtype={args.dtype}", f"model.overrides={json.dumps(overrides)}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        "optim.lr=1e-7", "optim.schedule=constant", f"train.steps={args.steps}", f"train.device={device}",
        "train.eval_every=0", "train.tensorboard=false", "train.progress=false", f"train.seed={args.seed}",
        f"async.max_staleness={eta}", f"async.workers={args.workers}", f"async.weight_transfer={args.transfer}",
        "async.worker_timeout_s=600",
    ])


def run_sync(args, threads: int) -> dict:
    torch.set_num_threads(threads)
    cfg = make_config(args, args.trainer_device)
    trainer = Trainer(cfg)
    # One untimed step first: it compiles the attention kernels and captures the decode
    # graphs, which the async runs (same process, started after this one) then reuse.
    trainer.step()
    t0 = time.perf_counter()
    gen = train = 0.0
    lengths = []
    for _ in range(args.steps):
        m = trainer.step()
        gen += m["time/rollout_s"]
        train += m["time/forward_s"] + m["time/update_s"]
        lengths += [sum(s.loss_mask) for s in trainer.last_samples]
    wall = time.perf_counter() - t0
    return dict(mode=f"sync/{threads}t" if args.device == "cpu" else "sync", eta="-", wall=wall, trainer_busy=train / wall, gen_busy=gen / wall, staleness=0.0,
                lengths=lengths)


def run_async(args, eta: int) -> dict:
    torch.set_num_threads(1 if args.trainer_device == "cpu" else args.threads[-1])
    cfg = make_config(args, args.trainer_device, eta)
    trainer = Trainer(cfg)
    options = AsyncOptions(worker_devices=args.worker_devices, worker_threads=1, proximal=args.proximal,
                           setup="treerl.devtools.longtail:register", deadline_s=args.deadline)
    runner = AsyncRunner(cfg, trainer, options, out_dir=args.out)
    stale, train_s, lengths = [], [0.0], []

    def on_step(metrics, samples):
        stale.append(metrics["staleness/mean"])
        train_s[0] += metrics["time/forward_s"] + metrics["time/update_s"] + metrics["async/publish_s"]
        lengths.extend(sum(s.loss_mask) for s in samples)

    try:
        runner.start()
        deadline = time.monotonic() + 900
        while not all(w.ready for w in runner.workers.values()):  # start-up is not timed
            runner.pump()
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not start")
            time.sleep(0.01)
        runner.counters["gen_seconds"] = 0.0
        t0 = time.perf_counter()
        runner._last_step_end = t0
        runner.run(args.steps, on_step)
        wall = time.perf_counter() - t0
    finally:
        runner.close()
    gen = runner.counters["gen_seconds"] / args.workers
    return dict(mode="async", eta=eta, wall=wall, trainer_busy=train_s[0] / wall, gen_busy=gen / wall,
                staleness=statistics.mean(stale), lengths=lengths)


def run_rollout(args) -> list[dict]:
    from treerl.rollout import PromptQueue, RolloutEngine

    torch.set_num_threads(args.threads[-1])
    trainer = Trainer(make_config(args, args.trainer_device))
    params = trainer.sampler.sampling_params(args.group)
    prompts = [trainer.sampler.format.prompt_ids(trainer.tokenizer, p.prompt)
               for p in trainer.sampler.next_problems(args.steps * args.prompts)]
    steps = [prompts[i * args.prompts:(i + 1) * args.prompts] for i in range(args.steps)]
    rows = []

    def record(mode, engine, wall, groups, stats):
        tokens = sum(len(c) for g in groups for c in g)
        rows.append(dict(mode=mode, wall=wall, tokens=tokens, decode_steps=stats["decode_steps"],
                         rows_per_step=stats["decode_rows"] / max(stats["decode_steps"], 1),
                         live=stats["live_rows"] / max(stats["decode_rows"], 1) if stats["live_rows"] else None,
                         lengths=[len(c) for g in groups for c in g]))

    def totals(acc, stats):
        for k in ("decode_steps", "decode_rows", "live_rows"):
            acc[k] = acc.get(k, 0) + getattr(stats, k)

    engine = RolloutEngine(trainer.model)
    engine.generate(steps[0][:1], params)  # warm-up
    acc, groups = {}, []
    t0 = time.perf_counter()
    for i, batch in enumerate(steps):
        params.seed = args.seed + i
        groups += engine.generate(batch, params)
        totals(acc, engine.stats)
    record("generate/step", engine, time.perf_counter() - t0, groups, acc)
    eta = args.etas[0]
    engine = RolloutEngine(trainer.model)
    queue, waiting = PromptQueue(), list(prompts)
    ahead = (eta + 1) * args.prompts
    for _ in range(min(ahead, len(waiting))):
        queue.put(waiting.pop(0))
    if not waiting:
        queue.close()
    params.seed = args.seed
    groups = []
    t0 = time.perf_counter()
    for g in engine.generate_stream(queue, params, max_rows=ahead * args.group):
        groups.append(g)
        if waiting:
            queue.put(waiting.pop(0))
            if not waiting:
                queue.close()
    acc = {}
    totals(acc, engine.stats)
    record(f"stream/eta{eta}", engine, time.perf_counter() - t0, groups, acc)
    lengths = rows[0]["lengths"]
    print(f"\ncompletion lengths (generate/step run): mean {statistics.mean(lengths):.1f}, median "
          f"{statistics.median(lengths):.0f}, max {max(lengths)} tokens; {len(lengths)} completions per run")
    base = rows[0]["wall"]
    print(f"{'mode':16} {'wall s':>8} {'tok/s':>8} {'speedup':>8} {'decode steps':>12} {'rows/step':>9} {'live':>5}")
    for r in rows:
        live = "-" if r["live"] is None else f"{r['live']:.2f}"
        print(f"{r['mode']:16} {r['wall']:8.2f} {r['tokens'] / r['wall']:8.1f} {base / r['wall']:7.2f}x "
              f"{r['decode_steps']:12d} {r['rows_per_step']:9.1f} {live:>5}")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--etas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int)
    p.add_argument("--shape")
    p.add_argument("--dtype")
    p.add_argument("--prompts", type=int, help="prompt groups per step")
    p.add_argument("--group", type=int, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, help="longest completion (the tail's cap)")
    p.add_argument("--min-tokens", type=int, help="Pareto scale: shortest typical completion")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index (smaller: heavier tail)")
    p.add_argument("--vocab", type=int, help="model vocabulary (CPU default 4096; CUDA: the shape's)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, nargs="+",
                   help="CPU threads of the sync runs; the fastest is the baseline (default: 1 and 1 + workers)")
    p.add_argument("--transfer", default="auto", help="weight transfer: auto, shared, files, nccl")
    p.add_argument("--proximal", default="recompute", choices=["recompute", "loglinear"],
                   help="proximal logprobs of stale samples: tree forward, or AReaL's log-linear approximation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds before an async run is abandoned")
    p.add_argument("--out", default="runs/bench_async", help="scratch directory (file weight transfer)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--rollout-only", action="store_true",
                   help="measure generation only (a generate per step vs one stream), one process")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = parser().parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.threads = args.threads or sorted({1, 1 + args.workers})
    if args.vocab is None:  # the Trainer sizes the model to the tokenizer unless told otherwise
        args.vocab = SHAPES[args.shape]["vocab_size"]
    register()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.device == "cuda":
        n = torch.cuda.device_count()
        if n < 1 + args.workers:
            raise SystemExit(f"--device cuda needs {1 + args.workers} GPUs (trainer + workers), found {n}")
        args.trainer_device, args.worker_devices = "cuda:0", [f"cuda:{1 + i}" for i in range(args.workers)]
    else:
        args.trainer_device, args.worker_devices = "cpu", ["cpu"] * args.workers
    print(f"workload: {args.shape} {args.dtype}, {args.prompts} prompts x {args.group} samples per step, "
          f"{args.steps} steps, lengths Pareto(min {args.min_tokens}, alpha {args.alpha}) capped at {args.max_tokens}; "
          f"trainer {args.trainer_device}, workers {args.worker_devices}", file=sys.stderr)
    if args.rollout_only:
        rows = run_rollout(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump([{k: v for k, v in r.items() if k != "lengths"} for r in rows], f, indent=1)
        return rows
    results = [run_sync(args, t) for t in (args.threads if args.device == "cpu" else args.threads[-1:])]
    for eta in args.etas:
        results.append(run_async(args, eta))
    base = min(r["wall"] for r in results if r["mode"].startswith("sync"))
    samples = args.steps * args.prompts * args.group
    lengths = results[0]["lengths"]
    print(f"\ncompletion lengths (sync run): mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths):.0f}, "
          f"max {max(lengths)} tokens; {samples} trained samples per run")
    print(f"{'mode':8} {'eta':>3} {'wall s':>8} {'samples/s':>10} {'speedup':>8} {'staleness':>9} "
          f"{'trainer busy':>12} {'gen busy':>8}")
    for r in results:
        print(f"{r['mode']:8} {r['eta']!s:>3} {r['wall']:8.2f} {samples / r['wall']:10.1f} {base / r['wall']:7.2f}x "
              f"{r['staleness']:9.2f} {r['trainer_busy']:12.2f} {r['gen_busy']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "lengths"} | {"samples": samples} for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
