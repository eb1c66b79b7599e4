"""Tokens/s of treerl's RolloutEngine against Hugging Face ``model.generate``.

Same model (random weights, a named shape), same prompts, same sampling (temperature,
top-p, top-k), same ``max_new_tokens`` and group size (``num_return_sequences=G`` for
``generate``); no stop tokens, so both produce prompts x G x new-tokens tokens. Each engine
runs once untimed (warm-up, a few tokens), then ``--repeats`` timed runs (best kept).
On CUDA the table has five rows: RolloutEngine with CUDA graphs (its default there; the
continuous-batching path ``generate`` takes by default, and the wave path,
``continuous=False``) and without, ``model.generate`` as is, and ``model.generate`` with cuDNN SDPA disabled (torch
2.11 picks cuDNN attention, which re-plans at every new key length); the ratio column
compares with the faster ``model.generate`` row.

CPU (default, small shape):
    python bench/bench_rollout.py
GPU (about 75 s on an H200, all four rows; nothing to install):
    python bench/bench_rollout.py --device cuda --shape qwen3-0.6b --dtype bfloat16 \
        --prompts 8 --group 8 --prompt-len 1024 --new-tokens 512
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.models import SHAPES, build_model  # noqa: E402
from treerl.rollout import RolloutEngine, SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument("--no-cuda-graphs", action="store_true", help="no CUDA-graph RolloutEngine run")
    p.add_argument("--no-eager", action="store_true", help="no eager (no CUDA graphs) RolloutEngine run on CUDA")
    p.add_argument("--no-generate-variants", action="store_true",
                   help="on CUDA, skip model.generate with cuDNN SDPA disabled")
    p.add_argument("--skip-generate", action="store_true", help="time the RolloutEngine only")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = build_model(args.family, args.shape, dtype=dtype, device=device, seed=args.seed)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g)
    cuda = device.type == "cuda"
    n_tokens = args.prompts * args.group * args.new_tokens
    ids = prompts.to(device)
    mask = torch.ones_like(ids)

    def engine_runner(cuda_graphs, continuous=True):
        engine = RolloutEngine(model, sync_every=args.sync_every, cuda_graphs=cuda_graphs, continuous=continuous)

        def run(new_tokens):
            params = SamplingParams(
                n=args.group, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                max_new_tokens=new_tokens, seed=args.seed,
            )
            groups = engine.generate(prompts.tolist(), params)
            run.stats = engine.stats
            return sum(len(c) for grp in groups for c in grp)

        return run

    def generate_runner(cudnn_sdpa):
        def run(new_tokens):
            previous = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(cudnn_sdpa)
            try:
                with torch.no_grad():
                    out = model.generate(
                        input_ids=ids, attention_mask=mask, do_sample=args.temperature > 0,
                        temperature=args.temperature or None, top_p=args.top_p, top_k=args.top_k,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        num_return_sequences=args.group, eos_token_id=None, pad_token_id=0,
                    )
            finally:
                torch.backends.cuda.enable_cudnn_sdp(previous)
            return out.shape[0] * (out.shape[1] - ids.shape[1])

        return run

    runners = []
    if cuda and not args.no_cuda_graphs:
        runners.append(("RolloutEngine", engine_runner(True)))
        runners.append(("RolloutEngine (waves)", engine_runner(True, continuous=False)))
    if not cuda or not args.no_eager:
        runners.append(("RolloutEngine (eager)" if cuda else "RolloutEngine", engine_runner(False)))
        if not cuda:
            runners.append(("RolloutEngine (waves)", engine_runner(False, continuous=False)))
    if not args.skip_generate:
        runners.append(("model.generate", generate_runner(True)))
        if cuda and not args.no_generate_variants:
            runners.append(("model.generate (no cuDNN SDPA)", generate_runner(False)))

    rows = []
    warm = min(8, args.new_tokens)
    stats = None
    for name, run in runners:
        run(warm)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        seconds, produced = time_it(lambda: run(args.new_tokens), device, args.repeats)
        assert produced == n_tokens, (name, produced, n_tokens)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
        rows.append((name, produced, seconds, peak))
        stats = getattr(run, "stats", None) or stats
        print(f"  {name}: {seconds:.2f} s", flush=True)
    base = max((r[1] / r[2] for r in rows if r[0].startswith("model.generate")), default=rows[-1][1] / rows[-1][2])

    print(
        f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'})"
        f" torch={torch.__version__} shape={args.family}/{args.shape} dtype={dtype} prompts={args.prompts}"
        f" G={args.group} prompt_len={args.prompt_len} new_tokens={args.new_tokens}"
        f" T={args.temperature} top_p={args.top_p} top_k={args.top_k}"
    )
    print("ratio: tokens/s over the best model.generate row")
    print(f"{'engine':<32}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'ratio':>8}{'peak GiB':>10}")
    results = []
    for name, produced, seconds, peak in rows:
        tps = produced / seconds
        print(f"{name:<32}{produced:>10}{seconds:>10.3f}{tps:>12.1f}{tps / base:>8.2f}{peak:>10.1f}")
        results.append(dict(engine=name, tokens=produced, seconds=seconds, tokens_per_s=tps, ratio=tps / base,
                            peak_gib=peak))
    print(
        f"RolloutEngine: {stats.prefill_calls} prefill call(s), {stats.prefill_tokens} prompt tokens prefilled "
        f"(generate prefills {args.prompts * args.group * args.prompt_len}), {stats.decode_steps} decode steps"
    )
    report = dict(args={k: str(v) for k, v in vars(args).items()}, dtype=dtype, results=results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
