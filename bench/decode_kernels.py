"""The decode step's small Triton kernels alone, beside the time their bytes take at the HBM's rate:
the sampling race (:mod:`treerl.rollout.race_kernel`) and the Q/K norm + RoPE + K/V write
(:func:`treerl.rollout.rope_kernel.rope_write`), timed as CUDA graph replays
(``triton.testing.do_bench_cudagraph``).

- ``race``: rows x a Qwen vocabulary (151,936), float32 logits (the running batch's before session
  24) and bf16 (its pending logits since), every row sampled at T = 1 or all greedy (no noise);
  each call's tokens checked against the torch reference; ``--race-sweep``: bf16 over its launch settings.
- ``rope``: Qwen3-0.6B / 1.7B heads (16 query, 8 KV heads of 128), bf16, groups of 8, the token
  written into a paged pool.
- ``attention``: one layer's decode attention as the kernel step runs it, the prompt part's key
  ranges (:func:`~treerl.rollout.decode_attention.split_attention`) then the rows' own part merged
  with them (:func:`~treerl.rollout.decode_attention.split_attention_merged`, paged in blocks of
  64), Qwen3 heads (16 over 8 KV heads of 128), bf16, a prompt of 1,024 tokens per group; cases
  ``groups x rows : own keys``; run in turn and overlapped (``trigger``/``after``, where
  :func:`~treerl.rollout.decode_attention.overlap_ok`; ``--prompt-targets``: the prompt part's
  programs at least, each timed), outputs compared bit for bit (other key ranges: to bf16's rounding);
  each replay runs ``--layers`` layers, each over its own buffers (as a step: no L2 reuse), us a layer.
- ``products``: a layer's products as the decode step runs them (:func:`product_rows`), cuBLAS + the
  compiled tail against cuBLAS + :mod:`treerl.rollout.silu_gate` between the tail's compiled halves, against
  :mod:`treerl.rollout.small_products` + the compiled residual norms (at most their ``MAX_ROWS`` rows), the SiLU
  gate alone (:func:`_silu_gate_rows`: inductor's kernel against ``silu_gate``), and the Q/K/V
  product + rope kernel in turn against linked (:func:`_qkv_rope_rows`), over every layer's weights a replay
  (random Qwen3 weights, ``--product-shape``); ``--product-sweep`` times each small product alone over its tiles.

Runs the kernels of whichever treerl is first on ``PYTHONPATH`` (an A/B: once per tree):

    PYTHONPATH=src python bench/decode_kernels.py --out $OUT/decode_kernels_new.json
    PYTHONPATH=.v/base/src python bench/decode_kernels.py --out $OUT/decode_kernels_base.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch


def race_rows(rows_list: list[int], vocab: int, bandwidth: float, sweep: bool = False) -> list[dict]:
    """The sampling race alone (float32 and bf16 logits; every row at T = 1, or greedy), tokens against the torch
    reference; with ``sweep``, bf16 at T = 1 over its launch settings (``race_kernel``'s ``TARGET_PROGRAMS``,
    ``BLOCK``, ``NUM_WARPS``: the tokens are the same bits at every setting)."""
    import treerl.rollout.race_kernel as rk
    from treerl.rollout.race_kernel import race_kernel
    from treerl.rollout.sampling import draw_seeds, race_reference

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in rows_list:
        base = torch.randn(rows, vocab, device="cuda", generator=g) * 4
        seeds = draw_seeds(rows, g, base.device)
        tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
        logp = torch.empty(rows, device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            logits = base.to(dtype)
            for name, t in (("T=1", torch.ones(1, device="cuda")), ("greedy", torch.zeros(1, device="cuda"))):
                tok, _ = race_kernel(logits, t, seeds, tokens, logp)
                same = bool(torch.equal(tok, race_reference(logits, t, seeds)[0]))
                run = lambda: race_kernel(logits, t, seeds, tokens, logp)  # noqa: E731
                out.append(dict(kernel="race", rows=rows, dtype=str(dtype).removeprefix("torch."), rows_sampled=name,
                                tokens_equal_reference=same, **_timed(run, logits.numel() * logits.element_size(),
                                                                      bandwidth)))
        if not sweep:
            continue
        logits, t = base.bfloat16(), torch.ones(1, device="cuda")
        want = race_reference(logits, t, seeds)[0]
        default = {name: getattr(rk, name) for name in ("TARGET_PROGRAMS", "BLOCK", "NUM_WARPS")}
        try:
            for programs in (264, 528, 1056, 2112, 4224):
                for block in (1024, 2048, 4096):
                    for warps in (4, 8, 16):
                        rk.TARGET_PROGRAMS, rk.BLOCK, rk.NUM_WARPS = programs, block, warps
                        tok, _ = race_kernel(logits, t, seeds, tokens, logp)
                        run = lambda: race_kernel(logits, t, seeds, tokens, logp)  # noqa: E731
                        out.append(dict(kernel="race-sweep", rows=rows, TARGET_PROGRAMS=programs, BLOCK=block,
                                        NUM_WARPS=warps, tokens_equal_reference=bool(torch.equal(tok, want)),
                                        **_timed(run, logits.numel() * 2, bandwidth)))
        finally:
            for name, value in default.items():
                setattr(rk, name, value)
    return out


def rope_rows(rows_list: list[int], bandwidth: float) -> list[dict]:
    from treerl.rollout.rope_kernel import rope_write

    heads, kv_heads, D, G, page, dt = 16, 8, 128, 8, 64, torch.bfloat16
    norm = SimpleNamespace(weight=torch.rand(D, device="cuda", dtype=dt) + 0.5, variance_epsilon=1e-6)
    out = []
    for B in rows_list:
        qkv = torch.randn(B, 1, (heads + 2 * kv_heads) * D, device="cuda", dtype=dt)
        angle = torch.rand(B, 1, D, device="cuda")
        cos, sin = angle.cos().to(dt), angle.sin().to(dt)
        pools = [torch.zeros(B * 8, kv_heads, page, D, device="cuda", dtype=dt) for _ in range(2)]
        block = torch.randperm(B * 8, device="cuda")[:B]
        offset = torch.randint(0, page, (B,), device="cuda")
        run = lambda: rope_write(qkv, cos, sin, norm, norm, heads, kv_heads, G, *pools, block, offset)  # noqa: E731
        moved = qkv.numel() * 2 + 2 * B * heads * D * 2 + 4 * B * kv_heads * D * 2  # read qkv; q twice, k/v twice
        out.append(dict(kernel="rope", rows=B, **_timed(run, moved, bandwidth)))
    return out


def attention_cases(cases: list[str], bandwidth: float, targets: list[int], layers: int,
                    prompt: int = 1024, sweep: list[str] = ()) -> list[dict]:
    """Each case's pair over ``layers`` layers' own buffers in one replay (a step's layers read
    different K/V: one layer's, replayed alone, would stay in the 50 MB L2 at 64 rows); us a layer.
    ``sweep``: kernel settings ``part:block_n:stages:warps`` (part ``own`` or ``prompt``), each timed
    alone and in the overlapped pair beside the other part at its defaults."""
    from treerl.rollout import blocks
    from treerl.rollout.decode_attention import (TARGET_PROGRAMS, overlap_ok, split_attention, split_attention_merged,
                                                 to_pages)

    # the engine's prompt part (blocks.PROMPT_PROGRAMS since session 30; a tree before it: the split kernel's target)
    engine_target = getattr(blocks, "PROMPT_PROGRAMS", TARGET_PROGRAMS)
    targets = targets or [engine_target]

    H, gq, D, page, dt = 8, 2, 128, 64, torch.bfloat16
    overlap = overlap_ok("cuda:0", dt, D, D)
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for case in cases:
        shape, own = case.split(":")
        groups, G = (int(x) for x in shape.split("x"))
        L, rows = int(own), groups * G
        n = -(-L // page) * page
        randn = lambda *size: torch.randn(*size, device="cuda", dtype=dt, generator=g)  # noqa: E731
        p_mask = torch.zeros(groups, prompt, device="cuda", dtype=dt)
        o_mask = torch.zeros(rows, n, device="cuda", dtype=dt)
        o_mask[:, L:] = torch.finfo(dt).min
        stack = [dict(q_pre=randn(groups, H, G * gq, D), pk=randn(groups, H, prompt, D), pv=randn(groups, H, prompt, D),
                      q_own=randn(rows, H, gq, D), own=to_pages(randn(rows, H, n, D), randn(rows, H, n, D), page, g))
                 for _ in range(layers)]
        moved = (groups * prompt + rows * L) * H * 2 * D * 2 * layers

        def prompt_part(x, overlapped=False, target=engine_target, **settings):
            return split_attention(x["q_pre"], x["pk"], x["pv"], p_mask, D ** -0.5, trigger=overlapped, target=target,
                                   **settings)

        def own_part(x, o_pre, l_pre, overlapped=False, **settings):
            ok, ov, table = x["own"]
            return split_attention_merged(x["q_own"], ok, ov, o_mask, D ** -0.5, o_pre, l_pre, G, dt, table=table,
                                          after=overlapped, **settings)

        def step(overlapped: bool, target: int = engine_target, own=None, pre=None):
            return [own_part(x, *prompt_part(x, overlapped, target, **(pre or {})), overlapped, **(own or {}))
                    for x in stack]

        want = step(False)
        kept = [prompt_part(x) for x in stack]
        per_layer = lambda row: round(row["us"] / layers, 2)  # noqa: E731
        parts = dict(prompt_part_us=per_layer(_timed(lambda: [prompt_part(x) for x in stack], 0, 1)),
                     own_part_us=per_layer(_timed(lambda: [own_part(x, *k) for x, k in zip(stack, kept)], 0, 1)))
        out.append(dict(kernel="attention-parts", case=case, **parts))
        runs = [(False, engine_target)] + [(True, t) for t in targets if overlap]
        for overlapped, target in runs:  # (the prompt part's programs at least: its key ranges are chosen to reach it)
            got = step(overlapped, target)
            same = all(torch.equal(a, b) if target == engine_target else
                       torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0) for a, b in zip(got, want))
            row = _timed(lambda o=overlapped, t=target: step(o, t), moved, bandwidth)
            out.append(dict(kernel="attention", case=case, rows=rows, own_keys=L, overlapped=overlapped,
                            prompt_programs=target, agrees_in_turn=same, us_a_layer=per_layer(row),
                            floor_us_a_layer=round(row["floor_us"] / layers, 2)))
        for text in sweep:  # (other key tiles change the sums' order: compared to bf16's rounding)
            part, block_n, stages, warps = text.split(":")
            settings = dict(block_n=int(block_n), num_stages=int(stages), num_warps=int(warps))
            own, pre = (settings, None) if part == "own" else (None, settings)
            alone = (lambda: [own_part(x, *k, **settings) for x, k in zip(stack, kept)]) if part == "own" else \
                (lambda: [prompt_part(x, **settings) for x in stack])
            got = step(overlap, own=own, pre=pre)
            out.append(dict(kernel="attention-sweep", case=case, part=part, **settings,
                            agrees=all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=0) for a, b in zip(got, want)),
                            alone_us=per_layer(_timed(alone, 0, 1)),
                            pair_us=per_layer(_timed(lambda: step(overlap, own=own, pre=pre), 0, 1))))
    return out


@torch.no_grad()
def product_rows(rows_list: list[int], bandwidth: float, shape: str, sweep: bool, device: str = "cuda") -> list[dict]:
    """A layer's products as the decode step runs them, over every layer's own weights in one replay
    (a step's layers read different weights; one layer's would stay in the L2), us a layer:

    - ``tail``: after the attention, cuBLAS + the compiled tail (``layer_math._tail_norm``: output product,
      residual + norm, gate/up, SiLU gate, down product, residual + the next norm) against the same with the SiLU
      gate through its kernel (``layer_math._gated_tail``, ``cublas+silu_gate``), against the small-row
      kernels + the compiled residual norms (``layer_math._small_tail``) and, on sm_90+, the same kernels with
      their own residual norms as a chain of dependent launches (``chain``; ``chain-pointers``: with the
      products' tiles through per-thread addresses instead of TMA), outputs compared;
    - with ``sweep``: each small product alone over column tiles, K ranges, warps and stages,
      against ``F.linear`` on the same weights (the Q/K/V product too: as one K range)."""
    from treerl.models import build_model
    from treerl.rollout import blocks, layer_math, small_products as sp

    model = build_model("qwen3", shape, dtype=torch.bfloat16, device=device)
    layers = model.model.layers
    f = blocks.FusedProjections(layers)
    weights = [layer_math._small_layer(layer, f, i) for i, layer in enumerate(layers)]
    assert all(w is not None for w in weights), f"{shape}: a layer the small-row kernels do not take (layer_math._small_layer)"
    following = [layer_math._next_norm(model.model, i) for i in range(len(layers))]
    tail_norm, residual_norm = blocks._TAIL_NORM, blocks._RESIDUAL_NORM
    H, A = model.config.hidden_size, layers[0].self_attn.o_proj.in_features
    tail_bytes = sum(w.numel() * 2 for w in (weights[0][0], weights[0][2], weights[0][3]))  # a layer's weights after attention
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for rows in rows_list:
        hidden = torch.randn(rows, 1, H, device=device, dtype=torch.bfloat16, generator=g)
        attn = torch.randn(rows, 1, A, device=device, dtype=torch.bfloat16, generator=g)
        x = layers[0].input_layernorm(hidden).reshape(rows, H)

        def old_tail():
            return [tail_norm(layer, hidden, attn, f.gate_up_w[i], f.gate_up_b[i], f.o_w[i], f.down_w[i], following[i])
                    for i, layer in enumerate(layers)]

        def new_tail(chain=False):
            return [layer_math._small_tail(residual_norm, layer, hidden, attn, weights[i], following[i], chain)
                    for i, layer in enumerate(layers)]

        def gated_tail():
            return [layer_math._gated_tail(blocks._TAIL_FRONT, blocks._TAIL_BACK, layer, hidden, attn, f.gate_up_w[i],
                                           f.o_w[i], f.down_w[i], following[i]) for i, layer in enumerate(layers)]

        want = old_tail()
        n = len(layers)
        ways = [("cublas+compiled", old_tail), ("cublas+silu_gate", gated_tail)]
        small = rows <= sp.MAX_ROWS  # (above it the step runs cuBLAS: the small-row ways are not timed)
        if small:
            ways.append(("small", new_tail))
        if small and sp.chains_here(device):  # (the tail's kernels as a chain of dependent launches: sm_90+)
            ways.append(("small-chain", lambda: new_tail(True)))

            def pointers():  # (the chain with the products' tiles through per-thread addresses, not TMA)
                tma, sp.TMA = sp.TMA, False
                try:
                    return new_tail(True)
                finally:
                    sp.TMA = tma
            ways.append(("small-chain-pointers", pointers))
        for name, run in ways:
            got = run()
            err = max(float((a.float() - b.float()).abs().max() / a.float().abs().max()) for w, v in zip(want, got)
                      for a, b in zip(w, v))
            row = _timed(run, tail_bytes * n, bandwidth)
            out.append(dict(kernel="products-tail", rows=rows, way=name, max_rel_diff=round(err, 5),
                            us_a_layer=round(row["us"] / n, 2), floor_us_a_layer=round(row["floor_us"] / n, 2)))
        out += _silu_gate_rows(f, rows, bandwidth, g)
        if small:
            out += _qkv_rope_rows(layers, f, hidden, x, bandwidth, g)
        if not sweep or not small:
            continue
        act = torch.randn(rows, weights[0][3].shape[1], device=device, dtype=torch.bfloat16, generator=g)
        inputs = dict(qkv=(x, f.qkv_w), o=(attn.reshape(rows, A), [w[0] for w in weights]),
                      gate_up=(x, [w[2] for w in weights]), down=(act, [w[3] for w in weights]))
        for product, (inp, ws) in inputs.items():
            moved = sum(w.numel() * 2 for w in ws)
            row = _timed(lambda: [torch.nn.functional.linear(inp, w) for w in ws], moved, bandwidth)
            out.append(dict(kernel="product", product=product, rows=rows, way="cublas", us=round(row["us"] / n, 2)))
            for block_n in (16, 32, 64):
                for splits in {"gate_up": (None,), "qkv": (1, 2)}.get(product, (1, 2, 4, 8)):
                    for block_k, warps, stages in ((128, 4, 4), (128, 4, 5), (128, 8, 4), (64, 4, 6), (256, 4, 3)):
                        kw = dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
                        if product == "gate_up":
                            run = lambda: [sp.gated(inp, w, **kw) for w in ws]  # noqa: E731
                        else:
                            run = lambda: [sp.linear_partials(inp, w, splits=splits, **kw) for w in ws]  # noqa: E731
                        try:
                            row = _timed(run, moved, bandwidth)
                        except Exception as err:  # noqa: BLE001 - a tile that does not compile: recorded
                            out.append(dict(kernel="product", product=product, rows=rows, error=str(err)[:100], **kw))
                            continue
                        out.append(dict(kernel="product", product=product, rows=rows, way="small", splits=splits,
                                        us=round(row["us"] / n, 2), tbps=round(moved / row["us"] / 1e6, 2), **kw))
    return out


def _qkv_rope_rows(layers, f, hidden, x, bandwidth: float, g) -> list[dict]:
    """The Q/K/V product and the rope kernel over every layer's weights in one replay (``layer_math._qkv_rope``), us a
    layer: in turn (cuBLAS, then the kernel) against linked (the product's partials over 1, 2 or 4 ranges summed
    in the rope kernel, both links of the chain; sm_90+); outputs compared."""
    from treerl.rollout import layer_math, small_products as sp

    rows, n, dt, page = hidden.shape[0], len(layers), hidden.dtype, 64
    heads, kv_heads = layer_math._heads(layers[0])
    D = layers[0].self_attn.head_dim
    G = 8 if rows % 8 == 0 else 1
    angle = torch.rand(rows, 1, D, device=hidden.device, generator=g)
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)
    stores = [SimpleNamespace(ok=torch.zeros(rows + 1, kv_heads, page, D, device=hidden.device, dtype=dt),
                              ov=torch.zeros(rows + 1, kv_heads, page, D, device=hidden.device, dtype=dt)) for _ in layers]
    block = torch.randperm(rows, device=hidden.device, generator=g)
    offset = torch.randint(0, page, (rows,), device=hidden.device, generator=g)
    x3 = x.reshape(rows, 1, -1)
    moved = f.qkv_w[0].numel() * 2 * n

    def run(linked: bool, splits: int = 1):
        return [layer_math._qkv_rope(layer, x3, f.qkv_w[i], None, cos, sin, G, stores[i], block, offset, linked,
                                     splits=splits)
                for i, layer in enumerate(layers)]

    want = run(False)
    ways = [("in-turn", None)] + ([("linked", s) for s in (1, 2, 4)] if sp.chains_here(hidden.device) else [])
    out = []
    for name, splits in ways:
        got = run(name == "linked", splits or 1)
        err = max(float((a.float() - b.float()).abs().max() / a.float().abs().max()) for w, v in zip(want, got)
                  for a, b in zip(w, v))
        row = _timed(lambda: run(name == "linked", splits or 1), moved, bandwidth)
        out.append(dict(kernel="qkv-rope", rows=rows, way=name, splits=splits, max_rel_diff=round(err, 5),
                        us_a_layer=round(row["us"] / n, 2), floor_us_a_layer=round(row["floor_us"] / n, 2)))
    return out


def _silu_gate_rows(f, rows: int, bandwidth: float, g) -> list[dict]:
    """The SiLU gate alone over every layer's own ``[rows, 2 I]`` gate/up output (as the step reads it: a fresh
    buffer a layer), us a layer: inductor's kernel (``torch.compile``, dynamic shapes as the decode parts compile,
    and static), torch eager, and :func:`treerl.rollout.silu_gate.silu_gate`; outputs against eager's."""
    from treerl.rollout.silu_gate import silu_gate

    def gate(gu):
        gate, up = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    bufs = [torch.randn(rows, w.shape[0], device=w.device, generator=g).bfloat16() for w in f.gate_up_w]
    moved = sum(b.numel() * 2 * 3 // 2 for b in bufs)  # (2 I columns read, I written, a row)
    want = [gate(b) for b in bufs]
    ways = dict(eager=gate, inductor_dynamic=torch.compile(gate, dynamic=True),
                inductor_static=torch.compile(gate, dynamic=False), silu_gate=silu_gate)
    out = []
    for name, fn in ways.items():
        run = lambda: [fn(b) for b in bufs]  # noqa: E731
        err = max(float((a.float() - b.float()).abs().max() / a.float().abs().max()) for a, b in zip(want, run()))
        row = _timed(run, moved, bandwidth)
        out.append(dict(kernel="silu-gate", rows=rows, way=name, max_rel_diff=round(err, 5),
                        us_a_layer=round(row["us"] / len(bufs), 2), floor_us_a_layer=round(row["floor_us"] / len(bufs), 2),
                        tbps=round(moved / row["us"] / 1e6, 2)))
    return out


def _timed(run, moved_bytes: int, bandwidth: float) -> dict:
    import triton

    run()
    us = 1e3 * triton.testing.do_bench_cudagraph(run)
    return dict(us=round(us, 2), bytes=moved_bytes, floor_us=round(1e6 * moved_bytes / bandwidth, 2))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="race,rope,attention", help="of race, rope, attention, products")
    p.add_argument("--product-rows", default="16,64,128")
    p.add_argument("--product-shape", default="qwen3-0.6b")
    p.add_argument("--product-sweep", action="store_true", help="each small product alone over its tiles")
    p.add_argument("--attention-cases", default="8x8:16,8x8:256,8x8:512,64x16:32,64x16:256",
                   help="groups x rows a group : own keys a row (a prompt of 1,024 keys a group)")
    p.add_argument("--prompt-targets", default="", help="the overlapped prompt part's programs at least, each timed "
                   "(default: the engine's, blocks.PROMPT_PROGRAMS)")
    p.add_argument("--attention-sweep", default="", help="kernel settings part:block_n:stages:warps, comma-separated "
                   "(part own or prompt), each timed alone and in the overlapped pair")
    p.add_argument("--layers", type=int, default=28, help="layers a replay (attention: each its own buffers)")
    p.add_argument("--race-rows", default="64,1024")
    p.add_argument("--race-sweep", action="store_true", help="the race over its launch settings (bf16, T = 1)")
    p.add_argument("--rope-rows", default="64,256,1024")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--bandwidth", type=float, default=4.277e12, help="HBM bytes/s (H200 4.28e12, H100 3.0e12)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    kernels = args.kernels.split(",")
    if unknown := set(kernels) - {"race", "rope", "attention", "products"}:
        p.error(f"--kernels: unknown {sorted(unknown)}; choose from race, rope, attention, products")
    import treerl

    rows = lambda text: [int(r) for r in text.split(",") if r]  # noqa: E731
    results = []
    if "race" in kernels:
        results += race_rows(rows(args.race_rows), args.vocab, args.bandwidth, args.race_sweep)
    if "rope" in kernels:
        results += rope_rows(rows(args.rope_rows), args.bandwidth)
    if "attention" in kernels:
        results += attention_cases(args.attention_cases.split(","), args.bandwidth, rows(args.prompt_targets),
                                   args.layers, sweep=[t for t in args.attention_sweep.split(",") if t])
    if "products" in kernels:
        results += product_rows(rows(args.product_rows), args.bandwidth, args.product_shape, args.product_sweep)
    for row in results:
        print(row, flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(treerl=str(Path(treerl.__file__).parent), device=torch.cuda.get_device_name(),
                                            results=results), indent=1))


if __name__ == "__main__":
    main()
