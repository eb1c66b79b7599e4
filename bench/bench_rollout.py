"""Rollout throughput beside its bandwidth floor (treerl RolloutEngine, random weights).

Each case samples ``prompts x G`` rows of ``--new-tokens`` tokens (no stop tokens, so every
row generates exactly that many) from prompts of ``--prompt-len`` tokens, with the
``RolloutEngine.generate`` (continuous batching, shared prompt K/V;
on CUDA treerl's own decode blocks, compiled, captured in CUDA graphs). One untimed run first (captures the CUDA graphs, kept for the timed
run by ``keep_stream_buffers``), then ``--repeats`` timed runs (best kept).

Bandwidth floor, from the shapes: per decode step, read the weights once, each group's
prompt K/V once and each row's own (generated) K/V; summed over the ``T`` steps of a run
(row length ``t`` at step ``t``), over the HBM bandwidth ``--bandwidth`` (B/s; H100 ~3.0e12,
H200 ~4.3e12). ``floor tok/s`` = rows x T / that time; ``fraction`` = measured / floor.

GPU, all cases (Qwen3-0.6B shape 8x8 and 64x16, Qwen3-1.7B shape 8x8; then the 0.6B 8x8
case with the decode blocks eager, through HF's modules, and ``model.generate``):
    python bench/bench_rollout.py --device cuda --out $OUT/bench_rollout.json
CPU smoke run (tiny shapes):
    python bench/bench_rollout.py --cases tiny:2x2 --prompt-len 32 --new-tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine, SamplingParams  # noqa: E402

SHAPE_NAMES = {"0.6b": "qwen3-0.6b", "1.7b": "qwen3-1.7b", "tiny": "tiny", "small": "small"}
DEFAULT_GPU_CASES = "0.6b:8x8,0.6b:64x16,1.7b:8x8"
# extra rows on the first case (names): own decode blocks not compiled, the decode step through
# HF's modules (the previous path), HF model.generate
DEFAULT_GPU_EXTRAS = "eager-blocks,hf-step,generate"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--cases", default=None,
                   help=f"shape:PROMPTSxG,... (default on cuda: {DEFAULT_GPU_CASES}; cpu: tiny:4x4)")
    p.add_argument("--extras", default=None,
                   help=f"extra rows on the first case, of {DEFAULT_GPU_EXTRAS} (default: all on cuda, none on cpu)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=16)
    p.add_argument("--bandwidth", type=float, default=3.0e12, help="HBM bytes/s for the floor (H100 3.0e12)")
    p.add_argument("--memory-fraction", type=float, default=0.97,
                   help="of free GPU memory the K/V may take, after logits and prefill reserves")
    p.add_argument("--out", type=Path, default=None, help="write the results (JSON) here, updated after each row")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(model) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return c.num_hidden_layers * c.num_key_value_heads * 2 * head_dim * itemsize


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def floor_seconds(weights: int, bpt: int, prompts: int, rows: int, prompt_len: int, steps: int, bw: float) -> float:
    """Bytes a run must read at least: per step the weights, each prompt's K/V once, each
    row's own K/V (``t`` tokens at step ``t``), over ``bw``."""
    per_step = weights + prompts * prompt_len * bpt
    own = rows * bpt * steps * (steps - 1) / 2
    return (steps * per_step + own) / bw


def kv_budget(model, device, rows: int, groups: int, prompt_len: int, new_tokens: int, fraction: float,
              prefill_tokens: int) -> int:
    """K/V token slots for the engine: all rows at once if they fit in free memory (after
    reserves for the logits/sampling temporaries and a prefill piece), else what fits."""
    own = -(-new_tokens // 16) * 16  # a row's own slots, in blocks of (at most) 64 (treerl.rollout.paging)
    block = min(64, own)
    need = groups * (-(-prompt_len // 16) * 16 + (rows // groups) * (-(-own // block) * block))
    if device.type != "cuda":
        return need
    bpt = kv_bytes_per_token(model)
    free, _ = torch.cuda.mem_get_info(device)
    vocab = model.config.vocab_size
    # logits: the model's [rows, V] (bf16) + the engine's float32 copy + ~2 sampling temporaries;
    # a prefill piece's K/V and its copy; 1 GiB for activations and the allocator's slack
    reserve = rows * vocab * (2 + 4 * 3) + 2 * prefill_tokens * bpt + (1 << 30)
    fit = int((free * fraction - reserve) // bpt)
    return max(1, min(need, fit))


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    cases = [c.split(":") for c in (args.cases or (DEFAULT_GPU_CASES if cuda else "tiny:4x4")).split(",")]
    extras = [x for x in (args.extras if args.extras is not None else (DEFAULT_GPU_EXTRAS if cuda else "")).split(",") if x]
    report = dict(
        device=torch.cuda.get_device_name(device) if cuda else (platform.processor() or "cpu"),
        torch=torch.__version__, dtype=dtype, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        temperature=args.temperature, bandwidth=args.bandwidth, results=[],
    )
    T = args.new_tokens
    print(f"device={report['device']} torch={torch.__version__} dtype={dtype} prompt_len={args.prompt_len} "
          f"new_tokens={T} bandwidth={args.bandwidth:.2e} B/s", flush=True)
    header = (f"{'shape':<12}{'rows':>12}{'engine':<26}{'tok/s':>10}{'floor tok/s':>13}{'fraction':>9}"
              f"{'peak GiB':>9}{'seconds':>9}")
    print(header, flush=True)
    plan = [(shape, pg, "RolloutEngine", {}) for shape, pg in cases]
    extra_opts = {"eager-blocks": ("RolloutEngine (eager blocks)", dict(compile=False)),
                  "hf-step": ("RolloutEngine (HF step)", dict(hf_step=True)),
                  "generate": ("model.generate", dict(generate=True))}
    plan += [(cases[0][0], cases[0][1]) + extra_opts[x] for x in extras]  # last: they may be slow
    model, model_name = None, None
    for shape, pg, name, opt in plan:
        P, G = (int(x) for x in pg.split("x"))
        rows = P * G
        if model_name != shape:
            model = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            model = build_model(args.family, SHAPE_NAMES.get(shape, shape), dtype=dtype, device=device, seed=args.seed)
            model.eval()
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 0
            model_name = shape
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, vocab, (P, args.prompt_len), generator=g).tolist()
        bpt, weights = kv_bytes_per_token(model), weight_bytes(model)
        floor_s = floor_seconds(weights, bpt, P, rows, args.prompt_len, T, args.bandwidth)
        floor_tps = rows * T / floor_s
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        budget = kv_budget(model, device, rows, P, args.prompt_len, T, args.memory_fraction, 8192)
        entry = dict(shape=shape, prompts=P, group=G, rows=rows, engine=name, kv_budget_tokens=budget,
                     weight_bytes=weights, kv_bytes_per_token=bpt, floor_tokens_per_s=floor_tps)
        try:
            if opt.get("generate"):
                run = _generate_runner(model, prompts, G, args, device)
            else:
                engine = RolloutEngine(
                    model, sync_every=args.sync_every, max_batch_tokens=budget, keep_stream_buffers=True,
                    compile_decode=opt.get("compile"),
                    prefill_chunk_tokens=8192,
                )
                if opt.get("hf_step"):
                    engine.decode_blocks = None  # the decode step through the model's HF forward
                run = _engine_runner(engine, prompts, G, args)
            t0 = time.perf_counter()
            run()  # warm-up: CUDA graphs captured (and compiled) here
            sync(device)
            warm_s = time.perf_counter() - t0
            print(f"  ({shape} {pg} {name}: warm-up incl. capture/compile {warm_s:.1f} s)", flush=True)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            best = float("inf")
            for _ in range(args.repeats):
                sync(device)
                t0 = time.perf_counter()
                produced = run()
                sync(device)
                best = min(best, time.perf_counter() - t0)
            assert produced == rows * T, (name, produced, rows * T)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
            tps = produced / best
            entry.update(tokens=produced, seconds=best, warmup_seconds=warm_s, tokens_per_s=tps,
                         fraction_of_floor=tps / floor_tps, peak_gib=peak)
            stats = getattr(run, "stats", None)
            if stats is not None:
                entry.update(prefill_tokens=stats.prefill_tokens, decode_steps=stats.decode_steps,
                             decode_rows=stats.decode_rows, kv_slots=stats.kv_slots, preemptions=stats.preemptions,
                             compiled=getattr(run, "compiled", None), small_products=getattr(run, "small_products", None))
            print(f"{shape:<12}{f'{P}x{G}={rows}':>12}  {name:<24}{tps:>10.0f}{floor_tps:>13.0f}"
                  f"{tps / floor_tps:>9.2f}{peak:>9.1f}{best:>9.2f}", flush=True)
        except Exception as err:  # noqa: BLE001 - record and go on to the next case
            entry.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
            traceback.print_exc()
            print(f"{shape:<12}{f'{P}x{G}={rows}':>12}  {name:<24} FAILED {entry['error'][:200]}", flush=True)
        finally:
            run = engine = None
        report["results"].append(entry)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
    return report


def _engine_runner(engine: RolloutEngine, prompts, G, args):
    def run() -> int:
        params = SamplingParams(n=G, temperature=args.temperature, max_new_tokens=args.new_tokens, seed=args.seed)
        groups = engine.generate(prompts, params)
        run.stats = engine.stats
        run.compiled = engine.decode_blocks is not None and engine.decode_blocks.compiled
        run.small_products = getattr(engine.decode_blocks, "small", None)  # the small-row product kernels served steps
        return sum(len(c) for grp in groups for c in grp)

    return run


def _generate_runner(model, prompts, G, args, device):
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def run() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=args.temperature > 0,
                temperature=args.temperature or None, top_p=1.0, top_k=0,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                num_return_sequences=G, eos_token_id=None, pad_token_id=0,
            )
        return out.shape[0] * (out.shape[1] - ids.shape[1])

    return run


if __name__ == "__main__":
    main()
