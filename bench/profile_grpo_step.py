"""Where a GRPO step's rollout time goes: the same ``generate`` alone, back to back, and
inside the step (right after ``train_on``), with the engine's counters and a profile of
the in-step call (GPU busy time against wall time, kernels, graph captures, top host ops).

Issue 25 item 1: ``bench_grpo_step.py`` measured the rollout inside the step at 13.3k tok/s
where ``bench_rollout.py`` reaches 18.7k on the same work. This script says which part of
the difference is graph capture / buffer allocation at stream start (``step_builds``), the
fused-weight refresh, prefill, host syncs, or the batch's tail.

    python bench/profile_grpo_step.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --out $OUT/step_profile.json
    python bench/profile_grpo_step.py          # CPU smoke run, tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_grpo_step import RandomTask, RandomTokens, sync  # noqa: E402
from treerl.config import Config  # noqa: E402
from treerl.models import build_model  # noqa: E402
from treerl.rollout import SamplingParams  # noqa: E402
from treerl.trainer import Sample, Trainer  # noqa: E402


def samples_of(groups, version: int, gen: torch.Generator) -> list[Sample]:
    out = []
    for g in groups:
        for c in g.completions:
            p, t = len(c.prompt_ids), len(c.completion_ids)
            out.append(Sample(c.token_ids.tolist(), [False] * (p - 1) + [True] * t,
                              [0.0] * (p - 1) + c.logprobs.tolist(), [version] * (p - 1 + t),
                              float(torch.rand((), generator=gen)), g.prompt_index, len(out)))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--keep-buffers", default="0,1", help="RolloutEngine.keep_stream_buffers values to compare")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.prompt_len, args.new_tokens, args.prompts, args.group = 32, 16, 2, 4
    model = build_model("qwen3", args.shape, dtype=args.dtype, device=args.device)
    cfg = Config.from_yaml(None, [
        "engine.mode=auto", f"train.device={args.device}", "algorithm.kl_coef=0.001", "algorithm.minibatches=2",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
        "train.tensorboard=false", "optim.lr=1e-6"])
    trainer = Trainer(cfg, model=model, tokenizer=RandomTokens(model.config.vocab_size), task=RandomTask())
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size - 1, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(n=args.group, max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    engine = trainer.sampler.rollout

    def generate(label: str) -> tuple[list, dict]:
        sync(args.device)
        t0 = time.perf_counter()
        groups = engine.generate(prompts, params)
        sync(args.device)
        s = time.perf_counter() - t0
        row = dict(label=label, seconds=s, tok_s=sum(len(c) for g in groups for c in g) / s,
                   **{k: v for k, v in dataclasses.asdict(engine.stats).items() if k != "seconds"})
        print(f"  {label:<34} {s:6.3f} s  {row['tok_s']:8.0f} tok/s  step_builds={row['step_builds']} "
              f"prefill_calls={row['prefill_calls']} decode_steps={row['decode_steps']}", flush=True)
        return groups, row

    def train(groups) -> float:
        sync(args.device)
        t0 = time.perf_counter()
        trainer.train_on(samples_of(groups, engine.version, gen))
        sync(args.device)
        return time.perf_counter() - t0

    report = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU",
                  shape=args.shape, dtype=args.dtype, work=f"{args.prompts}x{args.group}, prompt {args.prompt_len}, "
                  f"{args.new_tokens} new", runs={})
    for keep in (int(k) for k in args.keep_buffers.split(",")):
        engine.keep_stream_buffers = bool(keep)
        engine.release_stream_buffers()
        print(f"\n== keep_stream_buffers={keep}", flush=True)
        rows = []
        g, _ = generate("warm-up (compile, capture)")
        train(g)
        g, r = generate("after train_on")
        rows.append(r)
        g, r = generate("back to back")
        rows.append(r)
        t_train = train(g)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                    + ([torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])) as prof:
            g, r = generate("after train_on (profiled)")
        rows.append(r)
        busy, kernels, host = 0.0, 0, defaultdict(float)
        counts = defaultdict(int)
        for ev in prof.key_averages():
            dev_t = getattr(ev, "device_time_total", 0.0) or 0.0
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                busy += dev_t
                kernels += ev.count
            else:
                host[ev.key] += ev.self_cpu_time_total
                if any(k in ev.key for k in ("cudaGraphLaunch", "BeginCapture", "EndCapture", "cudaGraphInstantiate",
                                             "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree",
                                             "cudaMemcpy")):
                    counts[ev.key] += ev.count
        top_host = dict(sorted(((k, v / 1e3) for k, v in host.items()), key=lambda kv: -kv[1])[:20])
        prof_row = dict(gpu_busy_s=busy / 1e6, kernels=kernels, api_counts=dict(counts), top_host_self_ms=top_host,
                        train_on_s=t_train)
        print(f"  profiled call: GPU busy {busy / 1e6:.3f} s of {r['seconds']:.3f} s wall, {kernels} kernels; "
              f"API calls {dict(counts)}", flush=True)
        for k, v in list(top_host.items())[:10]:
            print(f"     host self {v:9.1f} ms  {k[:90]}")
        report["runs"][f"keep_stream_buffers={keep}"] = dict(rows=rows, profile=prof_row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
