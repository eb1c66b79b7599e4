"""Does the 1,024-row decode attention keep its rate on part of the GPU's SMs? (issue 25: 1,024 rows at 0.65 of
the floor, goal 0.70; the two-batch overlap lost because the attention's programs hold every SM: tbo_probe.py)

If the split attention (bound by the HBM) reached its rate on ~half the SMs, half the rows' attention on those SMs
beside the other half's products (bound by the tensor cores) on the rest could hide most of the products (~2 ms of a
~13.5 ms step). This probe, on tbo_probe.py's layers (28 layers' own buffers, Qwen3-0.6B heads and widths, bf16, a
1,024-token prompt per group of 16 rows, us a layer, eager launches timed by CUDA events: green contexts' streams
are not captured here), times:

- ``attention_all`` / ``attention_half`` on a green context of N SMs (N in ``--sms``; 0: the default stream, all);
- ``products_half`` on a green context of N SMs;
- ``split N``: per layer, half A's attention on a green context of N SMs beside half B's products on the default
  stream (which also reaches the SMs the attention leaves), then the halves swapped (fork and join per phase);
- ``serial``: all rows' attention then products on the default stream (the step as it runs), eager as the rest.

Prediction (written before the run): the attention loses <= 10% of its rate down to ~2/3 of the SMs and more below;
``split`` beats ``serial`` by at most ~10% at N ~ 88 and loses at small N (the products on ~44 SMs take ~3x their
time). If ``split`` is no better than ``serial`` at any N, SM partitioning is not a lever at this shape.

    PYTHONPATH=src:bench/device python3 bench/device/sm_split_probe.py --out $OUT/sm_split.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tbo_probe import layer_work


def timed(run, repeats: int = 10, warmup: int = 3) -> float:
    """Median ms of ``run()`` (eager, between CUDA events on the default stream; ``run`` joins its side streams)."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="64x16:256,64x16:128")
    p.add_argument("--sms", default="0,112,96,88,80,72,64,48,32")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    from torch.cuda.green_contexts import GreenContext

    L = a.layers
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(0)
    streams, contexts = {0: torch.cuda.current_stream()}, []  # (the contexts kept alive beside their streams)
    for n in (int(x) for x in a.sms.split(",") if int(x)):
        try:
            contexts.append(GreenContext.create(num_sms=n, device_id=0))
            streams[n] = contexts[-1].Stream()
        except Exception as e:  # noqa: BLE001 - a count the driver refuses is reported and skipped
            print(f"green context of {n} SMs refused: {type(e).__name__}: {e}", flush=True)
    out = []
    for case in a.cases.split(","):
        attention, products = layer_work(case, L, g)
        cur = torch.cuda.current_stream()

        def on(stream, fn):
            """``fn()`` on ``stream`` after the default stream's work, joined back (one fork and join)."""
            if stream is cur:
                return fn()
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                fn()
            cur.wait_stream(stream)

        def split(stream):
            def phase(l, first, second):
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    attention(l, first)
                products(l, second)
                cur.wait_stream(stream)
            return lambda: [(phase(l, "A", "B"), phase(l, "B", "A")) for l in range(L)]

        per_layer = lambda run: round(1e3 * timed(run) / L, 2)  # noqa: E731
        row = dict(case=case, rows=attention.rows, own_keys=attention.own_keys, layers=L, total_sms=total_sms,
                   serial_us=per_layer(lambda: [(attention(l, "all"), products(l, "all")) for l in range(L)]),
                   products_all_us=per_layer(lambda: [products(l, "all") for l in range(L)]))
        for n, s in streams.items():
            row[f"attention_all_{n or total_sms}sm_us"] = per_layer(lambda s=s: on(s, lambda: [attention(l, "all") for l in range(L)]))
            row[f"attention_half_{n or total_sms}sm_us"] = per_layer(lambda s=s: on(s, lambda: [attention(l, "A") for l in range(L)]))
            row[f"products_half_{n or total_sms}sm_us"] = per_layer(lambda s=s: on(s, lambda: [products(l, "A") for l in range(L)]))
            if n:
                row[f"split_{n}sm_us"] = per_layer(split(s))
        splits = {k: v for k, v in row.items() if k.startswith("split_")}
        if splits:
            best = min(splits, key=splits.get)
            row["best_split"], row["best_split_saves_us"] = best, round(row["serial_us"] - splits[best], 2)
        print(json.dumps(row), flush=True)
        out.append(row)
        del attention, products
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=out), indent=1))


if __name__ == "__main__":
    main()
