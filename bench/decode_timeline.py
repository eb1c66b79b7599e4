"""Where a decode step's device idles between its kernels: the torch profiler's kernel timeline.

Builds the engine as ``profile_rollout.py`` does (``rollout_case``: random Qwen3 weights, bf16, every row at once,
CUDA graphs captured in a warm-up ``generate``), profiles one ``generate`` of ``--new-tokens`` tokens a
row, and reads each kernel's start and end from the trace. For every kernel name: launches a decode
step, median duration, and the gap from the end of the kernel before it on the device to its start
(negative: it started before that one ended, a programmatic dependent launch), summed a step where
positive. Also the device's idle time a step (no kernel running) and the step's wall time.

    PYTHONPATH=src python bench/decode_timeline.py --cases 0.6b:8x8 --out $OUT/timeline.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from treerl.models import build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_rollout import SHAPES, rollout_case  # noqa: E402


def kernels_of(trace: dict) -> list[tuple[float, float, str]]:
    """The trace's kernels as ``(start us, end us, name)``, in start order."""
    ks = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
          if e.get("cat") == "kernel" and "dur" in e]
    return sorted(ks)


def gaps_by_kernel(ks: list[tuple[float, float, str]], steps: int) -> tuple[dict, float]:
    """Per kernel name: launches a step, median duration and gap before it (us), positive gaps a step;
    and the device's idle us a step (time between the first and last kernel with none running)."""
    by = defaultdict(lambda: dict(n=0, dur=[], gap=[]))
    end, idle = ks[0][1], 0.0
    for start, stop, name in ks[1:]:
        gap = start - end
        b = by[name[:90]]
        b["n"] += 1
        b["dur"].append(stop - start)
        b["gap"].append(gap)
        idle += max(gap, 0.0)
        end = max(end, stop)
    table = {name: dict(per_step=b["n"] / steps, median_us=float(np.median(b["dur"])),
                        median_gap_us=float(np.median(b["gap"])),
                        positive_gaps_us_a_step=float(np.sum(np.maximum(b["gap"], 0)) / steps))
             for name, b in by.items()}
    return dict(sorted(table.items(), key=lambda kv: -kv[1]["positive_gaps_us_a_step"])), idle / steps


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="0.6b:8x8")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    report = dict(device=torch.cuda.get_device_name(dev), cases=[])
    for case in args.cases.split(","):
        shape, pg = case.split(":")
        P, G = (int(x) for x in pg.split("x"))
        model = build_model("qwen3", SHAPES[shape], dtype="bfloat16", device=dev, seed=0).eval()
        engine, prompts, params, _ = rollout_case(model, P, G, args.prompt_len, args.new_tokens)
        engine.generate(prompts, params)  # warm-up: captures, compiles
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            ks = kernels_of(json.loads(Path(f.name).read_text()))
        steps = max(engine.stats.decode_steps, 1)
        # the decode steps only: from the first kernel after the prefill's last (the first race launch) on
        first = next(i for i, k in enumerate(ks) if k[2] == "_partial")
        ks = ks[first + 2:]
        table, idle = gaps_by_kernel(ks, steps - 1)
        span = (ks[-1][1] - ks[0][0]) / (steps - 1)
        entry = dict(case=case, rows=P * G, steps=steps, us_a_step=span, idle_us_a_step=idle, kernels=table)
        report["cases"].append(entry)
        print(f"== {case}: {steps} steps, {span:.1f} us a step, device idle {idle:.1f} us a step", flush=True)
        print(f"   {'kernel':<60}{'a step':>8}{'median us':>11}{'gap before':>12}{'gaps a step':>13}")
        for name, r in table.items():
            print(f"   {name[:60]:<60}{r['per_step']:8.1f}{r['median_us']:11.2f}{r['median_gap_us']:12.2f}"
                  f"{r['positive_gaps_us_a_step']:13.1f}")
        del engine, model
        torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
