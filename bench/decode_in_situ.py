"""The decode step in place: at chosen steps of a ``generate``, the step timed alone and its attention timed alone
over the running batch's own pools, block table and masks, beside the bytes they read.

``decode_kernels.py --kernels attention`` times the attention on synthetic inputs (every row the same span, a
fresh pool per layer). This reads the engine's: rows admitted in waves (spans differ by group), blocks as the
allocator gave them, the step's own-slot bucket. At each probed step (the ``k``-th decode step of the timed
``generate``):

- ``step_us``: the step's CUDA graph replayed (the forward to the logits; it rewrites the same K/V slots and logits);
- ``attention_us``: every layer's two attention parts as the kernel step launches them (the prompt part's ranges,
  then the rows' own part merged with them, overlapped where the engine overlaps them), random queries, as one CUDA
  graph (``triton.testing.do_bench_cudagraph``);
- ``attention_bytes``: the K/V the step's masks make visible (each group's prompt keys once, each row's own keys),
  all layers; ``attention_tb_s`` = bytes / ``attention_us``; ``step_floor_us``: those bytes and the weights at
  ``--bandwidth``.

    PYTHONPATH=src python bench/decode_in_situ.py --cases 0.6b:64x16,0.6b:8x8 --out $OUT/in_situ.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from treerl.models import build_model  # noqa: E402
from treerl.rollout import blocks  # noqa: E402
from treerl.rollout.step import DecodeStep  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_rollout import SHAPES, rollout_case  # noqa: E402


def visible(mask: torch.Tensor) -> torch.Tensor:
    """Visible keys a mask row holds (the kernels' test: above the dtype's minimum), ``[rows]``."""
    return (mask.reshape(mask.shape[0], -1).float() > torch.finfo(mask.dtype).min).sum(-1)


@torch.no_grad()
def probe(step: DecodeStep, bandwidth: float, weight_bytes: int, reps: int) -> dict:
    """One step's timings and bytes (see the module docstring)."""
    import triton

    cache, dec = step.cache, step.engine.decode_blocks
    if dec is None or cache.forks:
        raise ValueError("decode_in_situ: needs the engine's decode blocks (a Qwen-family model) and a flat "
                         "batch (no fork levels: tree rollouts' fork segments are not replayed here)")
    layers = dec.base.layers
    hi, hg = step.own_mask.shape[0], step.prefix_mask.shape[0]
    H, D, Dv = cache.layers[0].ok.shape[1], cache.layers[0].ok.shape[-1], cache.layers[0].ov.shape[-1]
    gq = layers[0].self_attn.config.num_attention_heads // H
    own, pre = visible(step.own_mask), visible(step.prefix_mask)
    bpt = H * (D + Dv) * cache.layers[0].ok.element_size() * len(layers)
    moved = int(own.sum() + pre.sum()) * bpt
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    step.graph.replay()
    start.record()
    for _ in range(reps):
        step.graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_us = 1e3 * start.elapsed_time(end) / reps
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = cache.compute_dtype
    q_own = torch.randn(hi, H, gq, D, device="cuda", dtype=dt, generator=g)
    q_pre = torch.randn(hg, H, cache.G * gq, D, device="cuda", dtype=dt, generator=g)

    def attention():
        for i, layer in enumerate(layers):
            o_pre, l_pre, merge_g = dec._prompt_part(i, layer, cache, q_own, q_pre, None, None, step.prefix_mask,
                                                     "split", trigger=cache.overlap)
            cache.attend_own_merged(i, q_own, step.own_mask, layer.self_attn.scaling, o_pre, l_pre, merge_g, dt,
                                    after=cache.overlap)

    cache.begin_step(step.index, step.own_mask.shape[-1], step.prefix_mask, step.fork_index, step.fork_masks)
    try:
        attention()
        attention_us = 1e3 * triton.testing.do_bench_cudagraph(attention)
    finally:
        cache.end_step()
    live = own[own > 0]
    return dict(rows=hi, groups=hg, own_len=step.own_mask.shape[-1], live_rows=int(live.numel()),
                own_keys_min_median_max=[int(live.min()), int(live.median()), int(live.max())] if live.numel() else [],
                prompt_keys=int(pre.sum()), step_us=round(step_us, 1), attention_us=round(attention_us, 1),
                attention_bytes=moved, attention_floor_us=round(1e6 * moved / bandwidth, 1),
                attention_tb_s=round(moved / attention_us / 1e6, 3),
                step_floor_us=round(1e6 * (moved + weight_bytes) / bandwidth, 1))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="0.6b:64x16,0.6b:8x8")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--steps", default="32,128,256,384,480", help="decode steps of the timed generate to probe")
    p.add_argument("--reps", type=int, default=20, help="graph replays a step timing")
    p.add_argument("--bandwidth", type=float, default=4.277e12, help="HBM bytes/s (H200 4.28e12, H100 3.0e12)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    wanted = {int(s) for s in args.steps.split(",") if s}
    report = dict(device=torch.cuda.get_device_name(dev), prompt_programs=blocks.PROMPT_PROGRAMS, cases=[])
    original = DecodeStep.__call__
    for case in args.cases.split(","):
        shape, pg = case.split(":")
        P, G = (int(x) for x in pg.split("x"))
        model = build_model("qwen3", SHAPES[shape], dtype="bfloat16", device=dev, seed=0).eval()
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if embed.data_ptr() != head.data_ptr():  # untied: a step reads one embedding row a token, not the table
            weights -= embed.numel() * embed.element_size()
        engine, prompts, params, _ = rollout_case(model, P, G, args.prompt_len, args.new_tokens)
        engine.generate(prompts, params)  # warm-up: captures, compiles
        torch.cuda.synchronize()
        probes, count = [], [0]

        def call(self, _orig=original):
            out = _orig(self)
            count[0] += 1
            if count[0] in wanted and self.graph is not None:
                row = dict(step=count[0], **probe(self, args.bandwidth, weights, args.reps))
                probes.append(row)
                print(f"   {case} {row}", flush=True)
            return out

        DecodeStep.__call__ = call
        try:
            engine.generate(prompts, params)
        finally:
            DecodeStep.__call__ = original
        report["cases"].append(dict(case=case, weight_bytes=weights, probes=probes))
        del engine, model
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
