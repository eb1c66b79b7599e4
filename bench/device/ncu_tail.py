"""The 64-row decode step's kernels under Nsight Compute (session 28): one pass of the layer's kernels as the kernel
step runs them (cuBLAS Q/K/V, the rope kernel, the prompt and own attention parts, the small tail's five kernels),
eager, after warm-up passes, between cudaProfilerStart/Stop, so that ``ncu --profile-from-start off`` sees one layer's
kernels of a pass over 28 layers' own weights. Run as

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats ... \\
        python3 bench/device/ncu_tail.py [--rows 64] [--own 256]
"""

from __future__ import annotations

import argparse

import torch

from treerl.models import build_model
from treerl.rollout import blocks, small_products
from treerl.rollout.decode_attention import split_attention, split_attention_merged, to_pages


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--own", type=int, default=256, help="own keys a row (a 1,024-key prompt per group of 8)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    args = p.parse_args()
    dev, dt = args.device, torch.bfloat16
    model = build_model("qwen3", "qwen3-0.6b", dtype=dt, device=dev)
    layers = model.model.layers[: args.layers]
    f = blocks.FusedProjections(model.model.layers)
    weights = [blocks._small_layer(layer, f, i) for i, layer in enumerate(layers)]
    following = [blocks._next_norm(model.model, i) for i in range(len(layers))]
    B, G, H, gq, D, page, prompt = args.rows, 8, 8, 2, 128, 64, 1024
    hidden_size = model.config.hidden_size
    g = torch.Generator(device=dev).manual_seed(0)
    randn = lambda *size: torch.randn(*size, device=dev, dtype=dt, generator=g)  # noqa: E731
    hidden = randn(B, 1, hidden_size)
    x = layers[0].input_layernorm(hidden).reshape(B, hidden_size)
    n = -(-args.own // page) * page
    p_mask = torch.zeros(B // G, prompt, device=dev, dtype=dt)
    o_mask = torch.zeros(B, n, device=dev, dtype=dt)
    o_mask[:, args.own:] = torch.finfo(dt).min
    kv = [dict(q_pre=randn(B // G, H, G * gq, D), pk=randn(B // G, H, prompt, D), pv=randn(B // G, H, prompt, D),
               q_own=randn(B, H, gq, D), own=to_pages(randn(B, H, n, D), randn(B, H, n, D), page, g))
          for _ in layers]
    chain = small_products.chains_here(dev) and B >= small_products.CHAIN_MIN_ROWS
    overlap = dev == "cuda"  # (the two attention parts overlapped, as the kernel step runs them on sm_90+)

    def one_pass():
        h = hidden
        for i, layer in enumerate(layers):
            torch.nn.functional.linear(x, f.qkv_w[i])
            c = kv[i]
            o_pre, l_pre = split_attention(c["q_pre"], c["pk"], c["pv"], p_mask, D ** -0.5, trigger=overlap)
            ok, ov, table = c["own"]
            attn = split_attention_merged(c["q_own"], ok, ov, o_mask, D ** -0.5, o_pre, l_pre, G, dt, table=table,
                                          after=overlap, trigger=chain)
            h, _ = blocks._small_tail(blocks._RESIDUAL_NORM, layer, h, attn.reshape(B, 1, -1), weights[i],
                                      following[i], chain)

    for _ in range(3):
        one_pass()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    one_pass()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"rows {B}, own keys {args.own}, chain {chain}: one pass profiled", flush=True)


if __name__ == "__main__":
    main()
