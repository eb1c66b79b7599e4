"""The first forward_backward of a process, cold and with compiled kernels kept (issue 24 item 4).

    PYTHONPATH=src python bench/first_step.py --out bench/results/first_step_h100.json     # H100, ~4-6 min
    PYTHONPATH=src python bench/first_step.py --smoke                                 # CPU, tiny model

Runs fresh Python processes one after another, each timing its first ``forward_backward``
(compilation, the memory model's probe and the step itself) and its second (warm) on the
``grpo`` workload (Qwen3-1.7B shape, bf16, random weights, ``TreeEngine`` defaults, a
separable token-weighted loss):

1. ``cold``: an empty compile cache directory (``engine.compile_cache_dir``,
   :mod:`treerl.engine.compile_cache`);
2. ``warm``: the same directory (torch's inductor/AOTAutograd/autotune/Triton caches and the
   artifacts file the first run saved);
3. ``artifacts``: only the artifacts file (torch's own caches in a fresh directory): a new
   machine that carries the one file.

Per run: seconds of the first and second step, dynamo's compiled graphs and frames, the
recompiles (``--recompiles``: also ``TORCH_LOGS=recompiles`` into ``<out>.<run>.log``), and
torch's compile-time table. Children inherit no ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(args) -> None:
    import torch
    from torch._dynamo.utils import compile_times, counters

    from treerl import PrefixTree, TreeEngine
    from treerl.devtools.benchmark import weighted_logprob_loss
    from treerl.devtools.workloads import SCALES, make_workload
    from treerl.engine import compile_cache
    from treerl.models import build_model

    t_start = time.perf_counter()
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    model = build_model("qwen3", "tiny" if smoke else "qwen3-1.7b", dtype=torch.float32 if smoke else torch.bfloat16,
                        device=device, seed=0)
    model.train()
    engine = TreeEngine(model, compile=True, compile_cache_dir=args.cache_dir)
    loaded = (Path(args.cache_dir) / compile_cache.artifacts_name(device)).exists()
    tree = PrefixTree.from_sequences(make_workload("grpo", SCALES["small" if smoke else "paper"],
                                                   model.config.vocab_size))
    loss = weighted_logprob_loss(tree)
    setup = time.perf_counter() - t_start

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        engine.forward_backward(tree, loss, separable=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    first = step()
    graphs_first = int(counters["stats"]["unique_graphs"])
    second = step()
    artifacts = Path(args.cache_dir) / compile_cache.artifacts_name(device)
    out = dict(run=args.run, first_s=first, second_s=second, setup_s=setup, artifacts_loaded=loaded,
               artifacts_bytes=artifacts.stat().st_size if artifacts.exists() else 0,
               unique_graphs=int(counters["stats"]["unique_graphs"]), graphs_in_first_step=graphs_first,
               frames=dict(counters["frames"]), recompiles=int(counters["recompiles"].total()) if "recompiles" in counters
               else None, fxgraph_hits=int(counters["inductor"]["fxgraph_cache_hit"]),
               fxgraph_misses=int(counters["inductor"]["fxgraph_cache_miss"]),
               aot_hits=int(counters["aot_autograd"]["autograd_cache_hit"]),
               aot_misses=int(counters["aot_autograd"]["autograd_cache_miss"]),
               inductor_cache_dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), plan=engine.stats.plan,
               compile_times=compile_times(repr="str", aggregate=True))
    print("RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: the script end to end")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--runs", default="cold,warm,artifacts")
    ap.add_argument("--recompiles", action="store_true", help="TORCH_LOGS=recompiles into <out>.<run>.log")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="treerl-first-step-"))
    cache = work / "compile"
    results = dict(runs=[], cache_dir=str(cache))
    base_env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    for run in args.runs.split(","):
        env = dict(base_env)
        if run == "artifacts":  # torch's own caches start empty: only the artifacts file carries kernels
            env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "fresh-inductor")
        log = None
        if args.recompiles:
            env["TORCH_LOGS"] = "recompiles"
            log = Path(f"{args.out or work / 'first_step'}.{run}.log")
        cmd = [sys.executable, __file__, "--child", "--run", run, "--cache-dir", str(cache)] + (["--smoke"] if args.smoke else [])
        t = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if log is not None:
            log.write_text(done.stderr)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            row = dict(run=run, error=done.stderr[-2000:], wall_s=wall)
        else:
            row = json.loads(lines[-1][len("RESULT "):])
            row["wall_s"] = wall
        results["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "compile_times"}), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| run | first step s | second step s | process s | graphs | fx graph hits / misses | AOT hits / misses "
          "| artifacts loaded |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        if "error" in r:
            print(f"| {r['run']} | error | | | | | | |")
            continue
        print(f"| {r['run']} | {r['first_s']:.1f} | {r['second_s']:.2f} | {r['wall_s']:.0f} | {r['unique_graphs']} | "
              f"{r['fxgraph_hits']} / {r['fxgraph_misses']} | {r['aot_hits']} / {r['aot_misses']} | "
              f"{r['artifacts_loaded']} ({r['artifacts_bytes'] / 2**20:.1f} MiB) |")
    for r in results["runs"]:
        if "compile_times" in r:
            print(f"\n{r['run']}: compile times\n{r['compile_times']}")


if __name__ == "__main__":
    main()
