"""Where a streaming decode step's GPU time goes (torch profiler), by kernel class.

Builds a random-weight model, warms the engine up (CUDA graphs captured, blocks compiled),
then profiles one ``generate`` of ``--new-tokens`` tokens per row and prints, per decode
step: kernels launched, GPU time per class (matmul, attention, fused/triton, elementwise,
copies, sampling reductions), and the step's wall time against its bandwidth floor.

    python bench/profile_rollout.py --cases 0.6b:8x8,0.6b:64x16 --out $OUT/profile_rollout.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine, SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import kv_budget  # noqa: E402

SHAPES = {"0.6b": "qwen3-0.6b", "1.7b": "qwen3-1.7b", "tiny": "tiny", "small": "small"}
CLASSES = (  # first match wins (lower-case kernel names)
    ("attention", ("fmha", "attention", "flash")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("fused (triton)", ("triton",)),
    ("sampling", ("softmax", "argmax", "exponential", "topk", "sort", "cumsum", "log_softmax")),
    ("copies", ("copy", "memcpy", "memset", "scatter", "gather", "index", "cat")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "unrolled")),
)


def classify(name: str) -> str:
    n = name.lower()
    for cls, keys in CLASSES:
        if any(k in n for k in keys):
            return cls
    return "other"


def rollout_case(model, P: int, G: int, prompt_len: int, new_tokens: int, compile_decode: bool = True) -> tuple:
    """An engine and workload as ``bench_rollout.py`` runs them: every row at once where the K/V fits, prefill
    pieces of 8,192 tokens, ``P`` random prompts of ``prompt_len`` tokens, ``G`` samples each at T = 1, seed 0.
    Returns ``(engine, prompts, params, K/V budget in tokens)``."""
    budget = kv_budget(model, next(model.parameters()).device, P * G, P, prompt_len, new_tokens, 0.97, 8192)
    engine = RolloutEngine(model, sync_every=16, max_batch_tokens=budget, keep_stream_buffers=True,
                           compile_decode=compile_decode, prefill_chunk_tokens=8192)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (P, prompt_len), generator=g).tolist()
    return engine, prompts, SamplingParams(n=G, temperature=1.0, max_new_tokens=new_tokens, seed=0), budget


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="0.6b:8x8,0.6b:64x16")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--hf-step", action="store_true", help="decode through the HF forward (the previous path)")
    p.add_argument("--compile", type=int, default=1, help="compile the decode blocks (1) or not (0)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    report = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, cases=[])
    model, shape_now = None, None
    for case in args.cases.split(","):
        shape, pg = case.split(":")
        P, G = (int(x) for x in pg.split("x"))
        if shape != shape_now:
            model = build_model("qwen3", SHAPES[shape], dtype="bfloat16", device=dev, seed=0).eval()
            shape_now = shape
        engine, prompts, params, budget = rollout_case(model, P, G, args.prompt_len, args.new_tokens,
                                                       bool(args.compile))
        if args.hf_step:
            engine.decode_blocks = None
        t0 = time.perf_counter()
        engine.generate(prompts, params)  # warm-up: captures, compiles
        warm = time.perf_counter() - t0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        plain = time.perf_counter() - t0
        steps_plain = engine.stats.decode_steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        steps = max(engine.stats.decode_steps, 1)
        by_class, count = defaultdict(float), defaultdict(int)
        top, calls = defaultdict(float), defaultdict(float)
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            if t <= 0 or ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            cls = classify(ev.key)
            by_class[cls] += t / 1e3 / steps  # ms per decode step (prefill included, spread)
            count[cls] += ev.count / steps
            top[ev.key] += t / 1e3 / steps
            calls[ev.key] += ev.count / steps
        entry = dict(case=case, rows=P * G, warm_s=warm, run_s=plain, decode_steps=steps_plain,
                     ms_per_step_wall=plain * 1e3 / max(steps_plain, 1),
                     ms_per_step_by_class=dict(by_class), kernels_per_step=dict(count),
                     kernels_per_step_total=sum(count.values()),
                     top_kernels_ms=dict(sorted(top.items(), key=lambda kv: -kv[1])[:40]),
                     top_kernels_per_step={k: calls[k] for k, _ in sorted(top.items(), key=lambda kv: -kv[1])[:40]},
                     kv_budget_tokens=budget, rows_per_step=engine.stats.decode_rows / steps,
                     admissions=engine.stats.admissions, preemptions=engine.stats.preemptions,
                     compiled=engine.decode_blocks is not None and engine.decode_blocks.compiled)
        report["cases"].append(entry)
        print(f"\n== {case} ({P * G} rows) warm-up {warm:.1f} s, compiled={entry['compiled']}: "
              f"{entry['ms_per_step_wall']:.2f} ms/step wall (incl. prefill), "
              f"{entry['kernels_per_step_total']:.0f} kernels/step, {entry['rows_per_step']:.0f} rows/step, "
              f"{entry['admissions']} admissions, {entry['preemptions']} preemptions", flush=True)
        for cls in sorted(by_class, key=lambda c: -by_class[c]):
            print(f"   {cls:<16}{by_class[cls]:8.3f} ms/step {count[cls]:8.1f} kernels/step")
        for k, v in list(entry["top_kernels_ms"].items())[:20]:
            print(f"   {v:8.3f} ms {calls[k]:6.1f}/step  {k[:100]}")
        del engine
        torch.cuda.empty_cache()
        if args.out:  # after every case (a later case may run out of time)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
