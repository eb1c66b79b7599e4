"""The decode step's sampling race (:mod:`treerl.rollout.race_kernel`) alone: microseconds a call
beside the time one read of its logits takes at the HBM's rate.

Rows x a Qwen vocabulary (151,936), float32 logits (the running batch's before session 24) and
bf16 (its pending logits since), every row sampled at T = 1 or all greedy (no noise: what the
noise's hash costs), timed as CUDA graph replays (``triton.testing.do_bench_cudagraph``).
Runs the kernel of whichever treerl is first on ``PYTHONPATH`` (an A/B: run it once per tree):

    PYTHONPATH=src python bench/race_kernel.py --out $OUT/race_new.json
    PYTHONPATH=.v/base/src python bench/race_kernel.py --out $OUT/race_base.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,1024")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--bandwidth", type=float, default=4.277e12, help="HBM bytes/s (H200 4.28e12, H100 3.0e12)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    import triton

    import treerl
    from treerl.rollout.race_kernel import race_kernel
    from treerl.rollout.sampling import draw_seeds, race_reference

    results = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        base = torch.randn(rows, args.vocab, device="cuda", generator=g) * 4
        seeds = draw_seeds(rows, g, base.device)
        tokens = torch.empty(rows, dtype=torch.int64, device="cuda")
        logp = torch.empty(rows, device="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            logits = base.to(dtype)
            for name, t in (("T=1", torch.ones(1, device="cuda")), ("greedy", torch.zeros(1, device="cuda"))):
                tok, _ = race_kernel(logits, t, seeds, tokens, logp)
                same = bool(torch.equal(tok, race_reference(logits, t, seeds)[0]))
                us = 1e3 * triton.testing.do_bench_cudagraph(lambda: race_kernel(logits, t, seeds, tokens, logp))
                read_us = 1e6 * logits.numel() * logits.element_size() / args.bandwidth
                row = dict(rows=rows, dtype=str(dtype).removeprefix("torch."), rows_sampled=name, us=round(us, 2),
                           one_read_us=round(read_us, 2), tokens_equal_reference=same)
                results.append(row)
                print(row, flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(treerl=str(Path(treerl.__file__).parent), device=torch.cuda.get_device_name(),
                                            results=results), indent=1))


if __name__ == "__main__":
    main()
