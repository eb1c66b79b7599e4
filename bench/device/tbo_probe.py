"""Does a decode step gain from two-batch overlap? (issue 25: 1,024 rows at 0.66 of the floor, goal 0.70)

At 1,024 rows the step's attention reads its K/V at about the HBM's rate (~9.5 ms of a 13.5 ms step, session 31)
while its products (~2.2 ms, cuBLAS) are bound by the tensor cores: the two bounds are different units, so half
the rows' attention beside the other half's products could hide the products. This probe times, over every
layer's own buffers (no L2 reuse; us a layer, one CUDA-graph replay of ``--layers`` layers, Qwen3-0.6B heads and
widths, bf16, a 1,024-token prompt per group of 16 rows):

- ``attention`` / ``products`` alone for all the rows and for each half (the engine's kernels: the prompt part's
  key ranges then the own part merged, overlapped as the step runs them; the products as cuBLAS runs them above
  ``small_products.MAX_ROWS``: Q/K/V, output + residual, gate/up, SiLU gate, down + residual);
- ``serial``: a layer as the step runs it now (attention, then products, all rows);
- ``tbo``: a layer in two phases, each half's attention on one stream beside the other half's products on a
  second (fork and join per phase: the dependencies a two-batch step would have);
- ``free``: each half's whole step (attention then products, every layer) on its own stream, no joins (the
  simplest two-batch step: the hardware interleaves them as they drift);
- ``bound``: half A's attention over all layers on one stream beside half B's products over all layers on the
  other (no joins: the most overlap can buy).

Prediction (written before the run): ``tbo`` hides 30-60% of the products (-0.6..-1.3 ms a 1,024-row step) if the
attention's programs leave the tensor cores room; if the attention kernel's programs fill every SM's shared memory,
the products only run in the waves' gaps and ``tbo`` ~ ``serial`` (no lead).

Outcome (session 38, H200, bench/results/tbo_probe_h200_s38_call1.json): no lead, and worse. ``tbo`` +20% / +14% /
+10% over ``serial`` at 128 / 256 / 448 own keys; ``free`` +11% / +6% / +4%; even ``bound`` (no joins) overlaps 4%
of the halves (163 against 117 + 52 us at 128 keys): the attention's programs hold every SM, and each half runs less
efficiently than the whole (``serial_halves`` +19% / +13% / +9%). ``sm_split_probe.py`` asks whether the attention
keeps its rate on fewer SMs (green contexts), which would leave the rest to the products.

    PYTHONPATH=src python3 bench/device/tbo_probe.py --out $OUT/tbo_probe.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


SHAPE = dict(H=8, gq=2, D=128, page=64, dtype=torch.bfloat16, prompt=1024, hidden=1024, inter=3072)  # Qwen3-0.6B


def layer_work(case: str, layers: int, g: torch.Generator):
    """``case`` ("groups x rows : own keys") over ``layers`` layers' own buffers (random, bf16, CUDA): returns
    ``attention(l, part)`` and ``products(l, part)`` (part "all", "A" the first half of the groups' rows, "B" the
    rest; as the decode step runs them) and the properties ``rows``, ``own_keys``, ``overlap``, ``prompt_programs``."""
    from treerl.rollout import blocks
    from treerl.rollout.decode_attention import overlap_ok, split_attention, split_attention_merged, to_pages

    target = getattr(blocks, "PROMPT_PROGRAMS", 264)
    H, gq, D, page, dt, prompt, hidden, inter = (SHAPE[k] for k in ("H", "gq", "D", "page", "dtype", "prompt", "hidden",
                                                                     "inter"))
    overlap = overlap_ok("cuda:0", dt, D, D)
    randn = lambda *size, s=1.0: torch.randn(*size, device="cuda", dtype=dt, generator=g) * s  # noqa: E731
    L = layers
    weights = [dict(qkv=randn(4096, hidden, s=0.02), o=randn(hidden, 2048, s=0.02), gu=randn(2 * inter, hidden, s=0.02),
                    down=randn(hidden, inter, s=0.02)) for _ in range(L)]
    shape, own = case.split(":")
    groups, G = (int(x) for x in shape.split("x"))
    n, rows = int(own), groups * G
    n_pad = -(-n // page) * page
    p_mask = torch.zeros(groups, prompt, device="cuda", dtype=dt)
    o_mask = torch.zeros(rows, n_pad, device="cuda", dtype=dt)
    o_mask[:, n:] = torch.finfo(dt).min
    stack = []
    for _ in range(L):
        ok, ov, table = to_pages(randn(rows, H, n_pad, D), randn(rows, H, n_pad, D), page, g)
        stack.append(dict(q_pre=randn(groups, H, G * gq, D), pk=randn(groups, H, prompt, D),
                          pv=randn(groups, H, prompt, D), q_own=randn(rows, H, gq, D), ok=ok, ov=ov, table=table))
    xs = [randn(rows, hidden) for _ in range(L)]
    os_ = [randn(rows, 2048) for _ in range(L)]
    half_g, half_r = groups // 2, rows // 2
    parts = {"all": (slice(0, groups), slice(0, rows)), "A": (slice(0, half_g), slice(0, half_r)),
             "B": (slice(half_g, groups), slice(half_r, rows))}

    def attention(l: int, part: str) -> torch.Tensor:
        sg, sr = parts[part]
        x = stack[l]
        o_pre, l_pre = split_attention(x["q_pre"][sg], x["pk"][sg], x["pv"][sg], p_mask[sg], D ** -0.5,
                                       trigger=overlap, target=target)
        return split_attention_merged(x["q_own"][sr], x["ok"], x["ov"], o_mask[sr], D ** -0.5, o_pre, l_pre, G, dt,
                                      table=x["table"][sr], after=overlap)

    def products(l: int, part: str) -> torch.Tensor:
        sr = parts[part][1]
        w, x = weights[l], xs[l][sr]
        F.linear(x, w["qkv"])
        h = F.linear(os_[l][sr], w["o"]) + x
        gu = F.linear(h, w["gu"])
        return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], w["down"]) + h

    attention.rows, attention.own_keys, attention.overlap, attention.prompt_programs = rows, n, overlap, target
    return attention, products


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="64x16:128,64x16:256,64x16:448", help="groups x rows : own keys")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    import triton

    g = torch.Generator(device="cuda").manual_seed(0)
    L = a.layers
    rows_out = []
    bench = lambda run: round(1e3 * triton.testing.do_bench_cudagraph(run) / L, 2)  # noqa: E731
    side = torch.cuda.Stream()
    for case in a.cases.split(","):
        attention, products = layer_work(case, L, g)

        def concurrent(first, second) -> None:
            """``first()`` on the current stream beside ``second()`` on the side stream (fork, join)."""
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            first()
            with torch.cuda.stream(side):
                second()
            cur.wait_stream(side)

        runs = {
            "attention_all": lambda: [attention(l, "all") for l in range(L)],
            "attention_half": lambda: [attention(l, "A") for l in range(L)],
            "products_all": lambda: [products(l, "all") for l in range(L)],
            "products_half": lambda: [products(l, "A") for l in range(L)],
            "serial": lambda: [(attention(l, "all"), products(l, "all")) for l in range(L)],
            "serial_halves": lambda: [(attention(l, "A"), products(l, "B"), attention(l, "B"), products(l, "A"))
                                      for l in range(L)],
            "tbo": lambda: [(concurrent(lambda l=l: attention(l, "A"), lambda l=l: products(l, "B")),
                             concurrent(lambda l=l: attention(l, "B"), lambda l=l: products(l, "A"))) for l in range(L)],
            "tbo_products_first": lambda: [(concurrent(lambda l=l: products(l, "B"), lambda l=l: attention(l, "A")),
                                            concurrent(lambda l=l: products(l, "A"), lambda l=l: attention(l, "B")))
                                           for l in range(L)],
            "free": lambda: concurrent(lambda: [(attention(l, "A"), products(l, "A")) for l in range(L)],
                                       lambda: [(attention(l, "B"), products(l, "B")) for l in range(L)]),
            "bound": lambda: concurrent(lambda: [attention(l, "A") for l in range(L)],
                                        lambda: [products(l, "B") for l in range(L)]),
        }
        # the halves' attention equals the whole's rows (row-independent kernels; the prompt part's ranges per group)
        whole = attention(0, "all")
        halves = torch.cat([attention(0, "A"), attention(0, "B")])
        row = dict(case=case, rows=attention.rows, own_keys=attention.own_keys, layers=L, overlap=attention.overlap,
                   prompt_programs=attention.prompt_programs, halves_equal_whole=bool(torch.equal(whole, halves)))
        for name, run in runs.items():
            row[name + "_us"] = bench(run)
        row["tbo_saves_us"] = round(row["serial_us"] - row["tbo_us"], 2)
        row["products_hidden"] = round(row["tbo_saves_us"] / max(row["products_all_us"], 1e-9), 3)
        row["free_saves_us"] = round(row["serial_us"] - row["free_us"], 2)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        del attention, products
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
