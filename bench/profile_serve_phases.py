"""Where a decode step's period goes while serving: the torch profiler, run in the engine
thread (the profiler records the host operations of the thread that starts it) over
``--window`` decode steps of ``bench_serve.py``'s timed in-process run (from its first
decode step, or after ``--skip`` of its decode steps: after the untimed run and the alone probes), with the engine thread's phases labelled (``treerl.<phase>``
ranges: the decode step, sampling, admissions, reads of the decode log, stop checks,
deliveries). Prints the window's wall and device-busy milliseconds per decode step, each
phase's inclusive host milliseconds and count, the top host operations (self) and kernels, and
the device's idle time by what the engine thread was doing meanwhile. ``--cprofile PATH``: the same window
under cProfile (the engine thread's Python functions) instead of the torch profiler.

    PYTHONPATH=src python bench/profile_serve_phases.py --window 1000 --device cuda --shape qwen3-0.6b \
        --dtype bfloat16 --mixed --probe --turns 6 --min-tokens 16 --max-tokens 512 --modes in-process --repeats 1
"""

from __future__ import annotations

import bisect
import functools
import inspect
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve as bs  # noqa: E402

from treerl.rollout import log_reads, stream  # noqa: E402
from treerl.rollout.batch import DeviceBatch  # noqa: E402
from treerl.rollout.prefill import Prefiller  # noqa: E402
from treerl.rollout.prefill_graphs import MIN_SLOTS, MIN_WINDOW, PrefillGraphs, _pow2  # noqa: E402
from treerl.rollout.stream import RunningBatch  # noqa: E402
from treerl.serve.loop import EngineLoop  # noqa: E402

PHASES = {RunningBatch: ("_decode", "_sample", "_admit", "_fork", "_compact", "_ensure_blocks", "_take", "_cancel",
                         "_recompute", "_fit", "_load_prompts", "_store_prompts", "_load"),
          DeviceBatch: ("load", "set_logits"),
          Prefiller: ("__call__", "_load_cached", "_forward", "mask"),
          PrefillGraphs: ("__call__",),
          log_reads.LogReader: ("start", "_finish_oldest", "sync"),  # (due and finish go through _finish_oldest)
          log_reads.LogRead: ("result",),
          EngineLoop: ("_deliver",)}
SHAPES: list[tuple] = []  # each small prefill's (exact rows, window, slots, bucket rows, window, slots)
_bucket = PrefillGraphs.bucket


def bucket(self, rows: int, window: int, slots: int):
    b = _bucket(self, rows, window, slots)
    if b is not None:
        SHAPES.append((rows, window, slots, b.rows, b.window, b.slots))
    return b


PrefillGraphs.bucket = bucket


def labelled(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"treerl.{name}"):
            return fn(*args, **kwargs)
    return wrapper


for cls, names in PHASES.items():
    for n in names:
        fn = labelled(f"{cls.__name__}.{n}", getattr(cls, n))
        setattr(cls, n, staticmethod(fn) if isinstance(inspect.getattr_static(cls, n), staticmethod) else fn)
for n in ("record", "check_stops"):  # module functions LogReader calls by their module names
    setattr(log_reads, n, labelled(n, getattr(log_reads, n)))
stream.chunk_admission = labelled("chunk_admission", stream.chunk_admission)

STATE = {"runs": 0, "armed": False, "prof": None, "steps": 0, "skip": 0, "skipped": 0, "t0": 0.0, "window": 1000, "out": None, "events": [],
         "live_rows": 0, "live_keys": 0, "bytes_per_key": 0, "cprofile": None}
_decode, _run_agents = RunningBatch._decode, bs.run_agents


def timed_on_device(fn):
    """CUDA events around each decode step in the window: the device's own time for the step's
    kernels (also where the profiler's device activity is missing)."""
    if not torch.cuda.is_available():
        return fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    STATE["events"].append((a, b))
    return out


def report(prof, wall: float, steps: int) -> dict:
    """The window's per-step wall and device-busy time, phases (inclusive host), top host
    operations (self) and kernels; printed and returned."""
    dev, host, phases = bs.profile_tables(prof)
    busy = sum(t for t, _ in dev.values())
    out = {"steps": steps, "wall_ms": wall * 1e3, "wall_ms_per_step": wall * 1e3 / steps,
           "device_busy_ms_per_step": busy / steps, "kernels_per_step": sum(c for _, c in dev.values()) / steps,
           "phases_ms": dict(sorted(phases.items(), key=lambda kv: -kv[1][0])),
           "top_host_self_ms": dict(sorted(host.items(), key=lambda kv: -kv[1][0])[:30]),
           "top_kernels_ms": dict(sorted(dev.items(), key=lambda kv: -kv[1][0])[:20])}
    print(f"window: {steps} decode steps, {wall:.3f} s: {out['wall_ms_per_step']:.2f} ms a step, device busy "
          f"{out['device_busy_ms_per_step']:.2f} ms a step ({out['kernels_per_step']:.1f} kernels)")
    for what in ("phases_ms", "top_host_self_ms", "top_kernels_ms"):
        for k, (ms, n) in out[what].items():
            print(f"  {what:16} {ms:9.1f} ms {ms / steps:7.3f} ms/step {n:7d}x  {k[:110]}")
    out["device_ranges"] = device_ranges(prof, steps)
    out["device_idle"] = device_idle(prof, steps)
    return out


def innermost(ranges: list[tuple], starts: list[float], t: float, back: int) -> tuple | None:
    """The latest-starting of ``ranges`` (``(start, end, name)`` sorted by start; ``starts``
    their starts) that holds time ``t``: the innermost, as labelled ranges nest. A scan back
    over at most ``back`` ranges; None if none holds it."""
    i = bisect.bisect_right(starts, t) - 1
    for j in range(i, max(-1, i - back), -1):
        if ranges[j][1] >= t:
            return ranges[j]
    return None


def device_idle(prof, steps: int, min_us: float = 2.0) -> dict:
    """The window's device idle time (gaps of at least ``min_us`` between the union of its
    kernels and copies), each gap attributed to the innermost labelled host range of the
    engine thread at the gap's middle (what the host was doing while nothing was queued)."""
    busy, host = [], []
    for ev in prof.events():
        r = (ev.time_range.start, ev.time_range.end, ev.name)
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if not ev.name.startswith("treerl."):
                busy.append(r)
        elif ev.name.startswith("treerl."):
            host.append(r)
    if not busy:
        return {}
    busy.sort()
    host.sort()
    starts = [h[0] for h in host]
    per: dict[str, list] = {}
    end, total = busy[0][1], 0.0
    for b0, b1, _ in busy[1:]:
        if b0 - end >= min_us:
            inner = innermost(host, starts, (b0 + end) / 2, back=400)
            t = per.setdefault(inner[2] if inner else "(outside every range)", [0.0, 0])
            t[0] += (b0 - end) / 1e3
            t[1] += 1
            total += (b0 - end) / 1e3
        end = max(end, b1)
    out = {"idle_ms_per_step": total / steps,
           "by_host_range": {k: {"ms": v[0], "gaps": v[1]} for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])}}
    print(f"device idle {total:.1f} ms ({total / steps:.3f} ms/step) in gaps >= {min_us} us, by the engine thread's "
          "innermost range at each gap's middle:")
    for k, v in list(out["by_host_range"].items())[:14]:
        print(f"    idle {v['ms']:8.1f} ms {v['ms'] / steps:6.3f} ms/step {v['gaps']:6d} gaps  {k}")
    return out


def device_ranges(prof, steps: int) -> dict:
    """Each kernel's device time attributed to the innermost labelled range (on the device's
    timeline) that holds its start: per range, its kernels' total and top kernels."""
    ranges, kernels = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        (ranges if ev.name.startswith("treerl.") else kernels).append(
            (ev.time_range.start, ev.time_range.end, ev.name))
    ranges.sort()
    starts = [r[0] for r in ranges]
    per: dict[str, dict[str, list]] = {}
    for k0, k1, name in kernels:
        inner = innermost(ranges, starts, k0, back=64)
        key = inner[2] if inner else "(none)"
        t = per.setdefault(key, {}).setdefault(name, [0.0, 0])
        t[0] += (k1 - k0) / 1e3
        t[1] += 1
    out = {}
    for rn, ks in sorted(per.items(), key=lambda kv: -sum(v[0] for v in kv[1].values())):
        total = sum(v[0] for v in ks.values())
        top = dict(sorted(ks.items(), key=lambda kv: -kv[1][0])[:12])
        out[rn] = {"ms": total, "kernels": sum(v[1] for v in ks.values()), "top": top}
        print(f"device in {rn}: {total:.1f} ms ({total / steps:.3f} ms/step), {out[rn]['kernels']} kernels")
        for k, (ms, n) in top.items():
            print(f"    {ms:8.1f} ms {n:6d}x {k[:120]}")
    return out


def shapes_summary() -> dict:
    """The small prefills' padding: query slots and query x K/V slots of their buckets over
    their exact shapes' (the whole process: warm-up, alone probes and runs)."""
    if not SHAPES:
        return {}
    a = np.asarray(SHAPES, dtype=np.float64)
    out = {"count": len(SHAPES),
           "query_padding": float((a[:, 3] * a[:, 4]).sum() / (a[:, 0] * a[:, 1]).sum()),
           "attention_padding": float((a[:, 3] * a[:, 4] * a[:, 5]).sum() / (a[:, 0] * a[:, 1] * a[:, 2]).sum()),
           "in_a_larger_bucket": int(sum(tuple(x[3:]) != (_pow2(x[0], 1), _pow2(x[1], MIN_WINDOW), _pow2(x[2], MIN_SLOTS))
                                         for x in SHAPES)),
           "shapes": SHAPES[-400:]}
    print(f"small prefills: {len(SHAPES)}, padded query slots / exact {out['query_padding']:.2f}, "
          f"padded query x K/V slots / exact {out['attention_padding']:.2f}, {out['in_a_larger_bucket']} in a larger "
          "bucket than their own (a captured one that covers them)")
    return out


class CProfile:
    """``--cprofile PATH``: the window under cProfile instead (the engine thread's Python
    functions, self and inclusive time; no device figures), its top functions written to PATH."""

    def __init__(self, path: str):
        import cProfile
        self.path, self.pr = path, cProfile.Profile()

    def __enter__(self):
        self.pr.enable()

    def __exit__(self, *exc):
        import io
        import pstats
        self.pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(self.pr, stream=buf)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
        Path(self.path).write_text(buf.getvalue())


def decode(self):  # the engine thread: the profiler starts and stops here
    if STATE["armed"] and STATE["prof"] is None and STATE["steps"] == 0 and STATE["skipped"] < STATE["skip"]:
        STATE["skipped"] += 1  # (--skip: the window starts after the timed run's first decode steps)
    elif STATE["armed"] and STATE["prof"] is None and STATE["steps"] == 0:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
        STATE["prof"] = CProfile(STATE["cprofile"]) if STATE["cprofile"] else torch.profiler.profile(activities=acts)
        STATE["prof"].__enter__()
        STATE["t0"] = time.perf_counter()
    if STATE["prof"] is not None:  # the live rows' keys (host state, no sync): what the attention must read
        h = self.host
        STATE["live_rows"] += int(h.live.sum())
        STATE["live_keys"] += int((h.fed_h[h.live] - self.tree.own_start + 1).clip(min=0).sum())
        c = self.e.model.config
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        STATE["bytes_per_key"] = 2 * c.num_hidden_layers * c.num_key_value_heads * hd * self.e.kv_dtype.itemsize
    out = timed_on_device(lambda: _decode(self)) if STATE["prof"] is not None else _decode(self)
    if STATE["prof"] is not None:
        STATE["steps"] += 1
        if STATE["steps"] >= STATE["window"]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - STATE["t0"]
            prof, STATE["prof"] = STATE["prof"], None
            prof.__exit__(None, None, None)
            if isinstance(prof, CProfile):
                print(f"cProfile window: {STATE['steps']} decode steps, {wall:.3f} s: "
                      f"{wall * 1e3 / STATE['steps']:.2f} ms a step (the profiler's overhead included)")
                return out
            r = report(prof, wall, STATE["steps"])
            ev = STATE["events"]
            if ev:
                r["decode_device_ms_per_step"] = sum(a.elapsed_time(b) for a, b in ev) / len(ev)
                r["first_to_last_device_ms"] = ev[0][0].elapsed_time(ev[-1][1])
                print(f"decode steps' own device time {r['decode_device_ms_per_step']:.3f} ms a step (events); "
                      f"device clock over the window {r['first_to_last_device_ms']:.1f} ms")
            r["small_prefills"] = shapes_summary()
            n = STATE["steps"]
            r["live_rows_per_step"] = STATE["live_rows"] / n
            r["live_own_keys_per_step"] = STATE["live_keys"] / n
            r["live_own_kv_gb_per_step"] = STATE["live_keys"] * STATE["bytes_per_key"] / n / 1e9
            print(f"live rows {r['live_rows_per_step']:.1f} a step, {r['live_own_keys_per_step']:.0f} own keys a step: "
                  f"{r['live_own_kv_gb_per_step']:.2f} GB of K/V a step (all layers) to read")
            if STATE["out"]:
                Path(STATE["out"]).write_text(json.dumps(r, indent=1))
    return out


async def run_agents(*args, **kwargs):
    # (armed as the timed run starts: session 14's calls 2-3 armed at the untimed run's end, so their windows
    # began with the alone probes' one-row steps)
    STATE["armed"] = STATE["runs"] >= 1
    out = await _run_agents(*args, **kwargs)
    STATE["runs"] += 1
    return out


RunningBatch._decode, bs.run_agents = decode, run_agents

if __name__ == "__main__":
    argv = sys.argv[1:]
    for flag, key, kind in (("--window", "window", int), ("--skip", "skip", int), ("--profile-json", "out", str),
                              ("--cprofile", "cprofile", str)):
        if flag in argv:
            i = argv.index(flag)
            STATE[key] = kind(argv[i + 1])
            del argv[i:i + 2]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    bs.main(argv)
    shapes_summary()
