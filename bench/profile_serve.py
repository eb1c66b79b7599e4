"""Where the engine loop's time goes: ``bench_serve.py``'s in-process agents (same workload,
same options) with the running batch's phases timed and the torch operations each dispatches
counted (in the engine thread, outside the model's decode step).

Per phase: seconds, calls, milliseconds and operations per call. The operation counts are the
device-independent part: on a GPU each is a kernel launch or a host-side dispatch, so they
predict the host time of a phase where timings on a CPU (whose "device" work is the same
thread's) cannot. Also printed: the engine's counters (admissions, prefill tokens, decode
steps, rebuilds, preemptions) and the short request's latency alone and behind the agents.

CPU (the issue's workload; the timings are this machine's, the counters are not):
    python bench/profile_serve.py --static-kv --mixed --probe
    python bench/profile_serve.py --static-kv --mixed --probe --max-tokens 128
``--static-kv``: fixed-shape decode steps as on a GPU (the same buckets and scheduling).
A CPU tool: on a GPU the counting mode would run inside CUDA-graph captures and compiled
regions and change what it measures (use ``bench_serve.py`` there).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs  # noqa: E402

from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine, SamplingParams  # noqa: E402
from treerl.rollout import batch as device_batch  # noqa: E402
from treerl.rollout import prefill, stream  # noqa: E402
from treerl.serve import EngineLoop  # noqa: E402

PHASES = [(stream.RunningBatch, name, name) for name in
          ("_sync", "_fit", "_admit", "_sample", "_decode", "_ensure_blocks", "_compact", "_cancel", "_take")]
PHASES += [(stream, "chunk_admission", "chunk_admission"), (device_batch.DeviceBatch, "decode", "decode step (model)"), (prefill.Prefiller, "__call__", "prefill forward"),
           (stream.RunningBatch, "_store_prompts", "prefix-cache store")]


class Phases(TorchDispatchMode):
    """Times the phases (wrapped methods) and counts the operations dispatched in each (the
    innermost phase running), while entered (in the engine thread)."""

    def __init__(self):
        super().__init__()
        self.seconds, self.calls, self.ops = collections.Counter(), collections.Counter(), collections.Counter()
        self.stack = ["other"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, cls, name: str, label: str) -> None:
        f = getattr(cls, name)

        def timed(*a, **k):
            t = time.perf_counter()
            self.stack.append(label)
            try:
                return f(*a, **k)
            finally:
                self.stack.pop()
                self.seconds[label] += time.perf_counter() - t
                self.calls[label] += 1

        setattr(cls, name, timed)

    def clear(self) -> None:
        for c in (self.seconds, self.calls, self.ops):
            c.clear()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--static-kv", action="store_true", help="fixed-shape decode steps (a GPU's buckets)")
    p.add_argument("--max-batch-tokens", type=int, default=1 << 17, help="the engine's (its default)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    own, rest = p.parse_known_args(argv)
    args = bs.parse_args(rest)
    torch.set_num_threads(own.threads)
    phases = Phases()
    for cls, name, label in PHASES:
        phases.wrap(cls, name, label)
    context = args.prompt_len + args.turns * (args.max_tokens + args.tool_tokens) + 16
    model = build_model(args.family, args.shape, dtype=args.dtype or "float32", device=args.device, seed=args.seed,
                        max_position_embeddings=context)
    vocab = model.get_input_embeddings().num_embeddings
    engine = RolloutEngine(model, prefix_cache_tokens=args.prefix_cache_tokens,
                           prefill_chunk_tokens=args.prefill_chunk_tokens, static_kv=True if own.static_kv else None,
                           max_batch_tokens=own.max_batch_tokens)
    loop = EngineLoop(engine, max_rows=args.max_rows, idle_timeout_s=args.idle_timeout_s)
    turn = engine.generation_turn

    def counted_turn(timeout: float = 60.0):  # every admission and decode step of the engine thread, counted
        class Both:
            def __enter__(self):
                self.t = turn(timeout)
                self.t.__enter__()
                phases.__enter__()

            def __exit__(self, *exc):
                phases.__exit__(*exc)
                return self.t.__exit__(*exc)

        return Both()

    engine.generation_turn = counted_turn

    async def call(prompt, max_tokens, temperature):
        params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_tokens)
        [c] = await asyncio.wrap_future(loop.submit(prompt, params))
        return c.completion_ids.tolist()

    try:
        asyncio.run(bs.run_agents(args, vocab, call, range(args.agents)))  # untimed: the same work once
        alone = asyncio.run(bs.probe_alone(args, vocab, call)) if args.probe else []
        phases.clear()
        before = loop.engine_stats()
        start = time.perf_counter()
        r = asyncio.run(bs.run_agents(args, vocab, call, range(args.agents), args.probe))
        wall = time.perf_counter() - start
        after = loop.engine_stats()
    finally:
        loop.stop()
    print(f"{args.agents} agents x {args.turns} turns, prompt {args.prompt_len}, max_tokens "
          f"{args.min_tokens if args.mixed else args.max_tokens}-{args.max_tokens}, {args.shape} on {args.device}"
          f"{', static kv' if own.static_kv else ''}: {wall:.2f} s, {r['tokens'] / wall:.0f} tok/s")
    if args.probe and r["probe_latencies"]:
        a, b = np.percentile(alone, [50, 99]), np.percentile(r["probe_latencies"], [50, 99])
        print(f"short request alone p50 {a[0] * 1e3:.1f} ms p99 {a[1] * 1e3:.1f} ms; behind the agents p50 "
              f"{b[0] * 1e3:.1f} ms p99 {b[1] * 1e3:.1f} ms (x{b[0] / a[0]:.2f}, x{b[1] / a[1]:.2f})")
    print("engine:", {k: getattr(after, k) - getattr(before, k) for k in bs.COUNTERS})
    print(f"{'phase':24} {'s':>8} {'calls':>7} {'ms/call':>9} {'ops/call':>9}")
    for k in sorted(phases.seconds, key=lambda k: -phases.seconds[k]):
        n = max(phases.calls[k], 1)
        print(f"{k:24} {phases.seconds[k]:8.3f} {phases.calls[k]:7d} {1e3 * phases.seconds[k] / n:9.3f} "
              f"{phases.ops[k] / n:9.1f}")


if __name__ == "__main__":
    main()
