"""64 concurrent agents through ``treerl serve`` vs the same agents in process.

Each agent runs ``--turns`` turns: it sends its prompt (token ids: ``--prompt-len`` random
ids for the first turn), gets ``--max-tokens`` sampled tokens (no stop token, so every call
generates exactly that many), appends them and ``--tool-tokens`` random "tool result" ids,
and sends the longer prompt as its next turn (which the prefix cache extends).

- ``in-process``: the agents submit to a :class:`treerl.serve.EngineLoop` directly
  (one continuous batch, no HTTP, no JSON);
- ``served``: ``treerl serve`` runs as its own process, as deployed (the random-weight model
  saved to a temporary directory with ``save_pretrained``, beside a word-level tokenizer
  whose tokens are the ids written out, started as ``python -m treerl.cli serve --weights
  DIR``); the agents call its ``/v1/completions`` on loopback with the ``openai`` package
  (one shared ``AsyncOpenAI`` client).

``--mixed``: each call's ``max_tokens`` is drawn from ``[--min-tokens, --max-tokens]``
(uniform, seeded per agent and turn) and its temperature from ``--temperatures``: requests
with different settings share one running batch, and each mode does the same work.
``--probe``: while the agents run, one more client sends short requests one after the other
(``--probe-tokens`` greedy tokens after a ``--probe-prompt-len``-token prompt, a new prompt
each time); their latency behind the agents' long requests is reported next to their latency
alone (``--probe-alone`` probes on an idle engine before the agents start), p50 and p99; in process also split
at the probe's first token (when it reached the host: admission, prefill and the log's read) and the rest (its
decode steps), p50 alone and behind, to say which part of the latency the agents lengthen.

Both use the same engine settings (``RolloutEngine`` defaults plus ``--prefix-cache-tokens``
and ``--prefill-chunk-tokens``; the loop's ``--max-rows`` and ``--idle-timeout-s``), the same
weights and dtype; the in-process engine is freed before the server starts.
``--client-procs N`` runs the served agents' clients in N processes: the ``openai`` client
spends milliseconds of CPU per request on a long token-id prompt (it walks the list element
by element), and one process serialises that for all agents.

Each mode runs once untimed (CUDA graph captures, compilation, allocator warm-up), then
``--repeats`` timed runs (best kept). Reported per mode: generated tokens/s, request latency
percentiles, the clients' CPU per request (served), and the engine's counters over the kept
run (from :meth:`EngineLoop.engine_stats`, served: ``/health``): admission rounds and prompts
per round, prefill forwards and tokens, prefix-cache hit tokens, decode steps and mean live
rows per step, decode steps built (on CUDA: graph captures), prompt-store growths,
reallocations, preemptions (own K/V blocks ran out) and streams started (a stream ends after
``--idle-timeout-s`` idle); the host figures of the engine's process
(:meth:`EngineLoop.host_stats`): the engine thread's CPU seconds, seconds waiting for a CPU and
the rest of the run's wall time (waiting for the GIL, the device or work), and the garbage
collector's passes and seconds; then served / in-process.

GPU (the issue's workload: max_tokens 16-512, temperatures per call; where the engine loop's
time goes: ``bench/profile_serve.py``):
    python bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --mixed --probe --repeats 1 \
        --client-procs 4 --json mixed.json
    python bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --json out.json
    python bench/bench_serve.py --device cuda --shape qwen3-0.6b --dtype bfloat16 --client-procs 8 --json out8.json
CPU smoke run:
    python bench/bench_serve.py --device cpu --tiny --mixed --probe
    python bench/bench_serve.py --shape tiny --agents 8 --turns 2 --prompt-len 16 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

# this checkout's src, unless PYTHONPATH names a treerl: an A/B runs another commit's src through PYTHONPATH (session 15
# found that inserting ours first made session 14's serving A/Bs run main twice); an installed treerl (an editable
# install of another checkout) does not win over this one. The run prints and records the treerl it measured.
if not any((Path(p) / "treerl").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import treerl  # noqa: E402
from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine  # noqa: E402
from treerl.rollout import SamplingParams  # noqa: E402
from treerl.serve import EngineLoop  # noqa: E402

SRC = Path(treerl.__file__).resolve().parents[1]  # the treerl imported here: the server runs the same

# engine counters reported per mode (RolloutStats fields)
COUNTERS = ("admissions", "admitted", "prefill_calls", "prefill_graph_calls", "prefill_graph_builds", "prefill_tokens",
            "prefix_cache_hit_tokens", "decode_steps",
            "live_rows", "decode_rows", "step_builds", "prefix_grows", "reallocations", "preemptions",
            "generated_tokens")


# host figures reported per mode (EngineLoop.host_stats; served: /health's "host")
HOST = ("engine_thread_cpu_s", "engine_thread_cpu_wait_s", "other_threads_cpu_s", "gc_passes", "gc_s", "gc_full_passes",
        "gc_full_s")


def host_counters(h: dict) -> dict:
    """:data:`HOST` from :meth:`EngineLoop.host_stats` (cumulative)."""
    g, t = h["gc"], h["engine_thread"]
    return {"engine_thread_cpu_s": t["cpu_s"] or 0.0, "engine_thread_cpu_wait_s": t["cpu_wait_s"] or 0.0,
            "other_threads_cpu_s": sum(h.get("other_threads_cpu_s", {}).values()),
            "gc_passes": sum(g["passes"]), "gc_s": sum(g["seconds"]), "gc_full_passes": g["passes"][2],
            "gc_full_s": g["seconds"][2]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tool-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per call (--mixed: the most; the issue's 16-512)")
    p.add_argument("--mixed", action="store_true", help="max_tokens and temperature drawn per call")
    p.add_argument("--min-tokens", type=int, default=16, help="--mixed: the fewest tokens per call")
    p.add_argument("--temperatures", default="0,0.6,1.0", help="--mixed: temperatures drawn from")
    p.add_argument("--probe", action="store_true", help="measure a short request's latency behind the agents")
    p.add_argument("--probe-tokens", type=int, default=16)
    p.add_argument("--probe-prompt-len", type=int, default=64)
    p.add_argument("--probe-alone", type=int, default=32, help="probes on an idle engine (latency alone)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke settings: tiny shape, 8 agents x 2 turns, 16-token prompts, 4-16 tokens per call")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="in-process: one more run under the torch profiler "
                   "(device busy against wall time, the top kernels and host operations)")
    p.add_argument("--prefix-cache-tokens", type=int, default=1 << 17,
                   help="the engine's prefix cache in and out of process (treerl serve's default: 131,072)")
    p.add_argument("--prefill-chunk-tokens", type=int, default=8192, help="the engine's (its default: 8192)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="the engine's running-batch K/V in and out of process (fp8: not exact)")
    p.add_argument("--prefill-graph-tokens", type=int, default=None,
                   help="the engine's (default: 2048 on CUDA; 0: every prefill in its exact shape, no graphs)")
    p.add_argument("--max-rows", type=int, default=256, help="rows of the running batch (treerl serve's default)")
    p.add_argument("--idle-timeout-s", type=float, default=10.0,
                   help="the engine loop's (treerl serve's default: 1): long enough that the gap between two timed "
                        "runs (clients starting) does not end the running batch")
    p.add_argument("--client-procs", type=int, default=1,
                   help="served: processes the agents' openai clients run in (agent i in process i %% N)")
    p.add_argument("--modes", default="in-process,served")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--server-log", type=Path, default=None,
                   help="keep treerl serve's log (stderr) here (default: a temporary file, removed)")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.agents, args.turns, args.prompt_len, args.tool_tokens = "tiny", 8, 2, 16, 4
        args.max_tokens, args.min_tokens, args.repeats = 16, 4, 1
        args.probe_tokens, args.probe_prompt_len, args.probe_alone = 4, 8, 8
    if args.mixed and not 1 <= args.min_tokens <= args.max_tokens:
        p.error("--min-tokens must be in [1, --max-tokens]")
    return args


def call_plan(args, agent: int) -> list[tuple[int, float]]:
    """``(max_tokens, temperature)`` of each of ``agent``'s calls (the same in every mode)."""
    if not args.mixed:
        return [(args.max_tokens, 1.0)] * args.turns
    rng = random.Random(args.seed * 7919 + agent)
    temps = [float(t) for t in args.temperatures.split(",")]
    return [(rng.randint(args.min_tokens, args.max_tokens), rng.choice(temps)) for _ in range(args.turns)]


def probe_prompt(args, vocab: int, k: int) -> list[int]:
    rng = random.Random(10**6 + args.seed * 7919 + k)
    return [rng.randrange(vocab) for _ in range(args.probe_prompt_len)]


async def probe_alone(args, vocab: int, call) -> dict:
    """``--probe-alone`` short requests one after the other on an idle engine: their latencies (s) and, where the
    mode times it (in process), each one's first token (s after its start; else None)."""
    out = {"latencies": [], "ttfts": []}
    for k in range(args.probe_alone):
        first: list[float] = []
        t = time.perf_counter()
        await call(probe_prompt(args, vocab, k), args.probe_tokens, 0.0, first)
        out["latencies"].append(time.perf_counter() - t)
        out["ttfts"].append(first[0] - t if first else None)
    return out


# ---------------------------------------------------------------------- the agents
async def run_agents(args, vocab: int, call, agents: range, probe: bool = False, stop=None) -> dict:
    """Agents ``agents`` concurrently; ``call(prompt_ids, max_tokens, temperature) ->
    completion ids``. ``probe``: a short request after another while they run (``stop``: an
    event the agents' processes set when they finish, where this process runs the probe
    alone). Returns the
    tokens generated, each request's latency, the probes' latencies, the start and end
    (``time.monotonic``, one clock for every process of the machine) and this process's CPU
    seconds."""
    latencies: list[float] = []
    probes: list[float] = []
    probe_ttfts: list[float | None] = []  # each probe's first token, s after its start (None: the mode does not time it)
    probe_starts: list[float] = []  # seconds after the run's start
    probe_ends: list[float] = []  # time.monotonic() (one clock for every process: combine() drops those after the agents)
    tokens = 0
    done = asyncio.Event()
    t0 = time.perf_counter()

    async def agent(i: int) -> None:
        nonlocal tokens
        rng = random.Random(args.seed * 1000 + i)
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        for max_tokens, temperature in call_plan(args, i):
            t = time.perf_counter()
            ids = await call(prompt, max_tokens, temperature)
            latencies.append(time.perf_counter() - t)
            if len(ids) != max_tokens:
                raise RuntimeError(f"a call generated {len(ids)} tokens, expected {max_tokens}")
            tokens += len(ids)
            prompt = prompt + ids + [rng.randrange(vocab) for _ in range(args.tool_tokens)]

    def finished() -> bool:
        return done.is_set() if stop is None else stop.is_set()

    async def prober() -> None:
        k = 0
        while not finished():
            first: list[float] = []
            t = time.perf_counter()
            await call(probe_prompt(args, vocab, 10**5 + k), args.probe_tokens, 0.0, first)
            if not finished():  # only probes that ran entirely behind the agents
                probes.append(time.perf_counter() - t)
                probe_ttfts.append(first[0] - t if first else None)
                probe_starts.append(t - t0)
                probe_ends.append(time.monotonic())
            k += 1

    async def agents_then_done() -> None:
        try:
            await asyncio.gather(*(agent(i) for i in agents))
        finally:
            done.set()

    start, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(agents_then_done(), *([prober()] if probe else []))
    return {"tokens": tokens, "latencies": latencies, "probe_latencies": probes, "probe_starts": probe_starts,
            "probe_ends": probe_ends, "probe_ttfts": probe_ttfts,
            "start": start,
            "end": time.monotonic(), "cpu_s": time.process_time() - cpu}


def combine(parts: list[dict], prober: dict | None = None) -> dict:
    """One run's figures from its client processes' :func:`run_agents` results (``prober``: the
    probe's own process, if it ran in one: its probes, not its time or CPU)."""
    tokens = sum(p["tokens"] for p in parts)
    latencies = [x for p in parts for x in p["latencies"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    q = np.percentile(latencies, [50, 90, 99])
    out = {"tokens": tokens, "requests": len(latencies), "wall_s": wall, "tok_s": tokens / wall,
           "latency_p50_s": float(q[0]), "latency_p90_s": float(q[1]), "latency_p99_s": float(q[2]),
           "client_cpu_ms_per_request": 1000 * sum(p["cpu_s"] for p in parts) / len(latencies)}
    agents_end = max(p["end"] for p in parts)
    parts = parts + ([prober] if prober is not None else [])
    # only probes that ran entirely behind the agents (a prober of its own hears they finished a little late)
    behind = [(x, s, f) for p in parts for x, s, e, f in zip(p.get("probe_latencies", []), p.get("probe_starts", []),
                                                             p.get("probe_ends", []), p.get("probe_ttfts", []))
              if e <= agents_end]
    probes = [x for x, _, _ in behind]
    if probes:
        pq = np.percentile(probes, [50, 99])
        out |= {"probes": len(probes), "probe_p50_s": float(pq[0]), "probe_p99_s": float(pq[1])}
        out |= _ttft_split([(x, f) for x, _, f in behind], "probe")
        starts = [s for _, s, _ in behind]
        out["probe_slowest"] = [dict(start_s=round(s, 4), latency_s=round(x, 4))  # where the tail comes from
                                for x, s in sorted(zip(probes, starts), reverse=True)[:6]]
    return out


def _ttft_split(probes: list[tuple[float, float | None]], name: str) -> dict:
    """The probes' ``(latency, first token)`` pairs as the p50 of the first token and of the rest (the decode steps
    after it), where the mode timed the first token (in process); else nothing."""
    timed = [(x, f) for x, f in probes if f is not None]
    if not timed:
        return {}
    return {f"{name}_first_token_p50_s": float(np.percentile([f for _, f in timed], 50)),
            f"{name}_rest_p50_s": float(np.percentile([x - f for x, f in timed], 50))}


def measure(args, run, counters, alone=None) -> dict:
    """One untimed run, then ``--repeats`` timed ones; the best, with the engine counters it
    moved. ``alone()``: the probes' latencies on the idle engine (after the untimed run)."""
    t0 = time.perf_counter()
    run()
    print(f"  untimed run done ({time.perf_counter() - t0:.1f} s)", flush=True)
    alone_q = None
    if alone is not None:
        a = alone()
        q = np.percentile(a["latencies"], [50, 99])
        alone_q = ({"probe_alone_p50_s": float(q[0]), "probe_alone_p99_s": float(q[1])}
                   | _ttft_split(list(zip(a["latencies"], a["ttfts"])), "probe_alone"))
    best = None
    for _ in range(args.repeats):
        before = counters()
        r = run()
        print(f"  timed run done: {r['tok_s']:.1f} tok/s", flush=True)
        after = counters()
        r["engine"] = {k: after[k] - before[k] for k in COUNTERS + ("streams",)}
        r["host"] = {k: after[k] - before[k] for k in HOST}
        if best is None or r["tok_s"] > best["tok_s"]:
            best = r
    if alone_q is not None:
        best |= alone_q
        if "probe_p50_s" in best:
            best["probe_behind_over_alone_p50"] = best["probe_p50_s"] / best["probe_alone_p50_s"]
            best["probe_behind_over_alone_p99"] = best["probe_p99_s"] / best["probe_alone_p99_s"]
    return best


# ---------------------------------------------------------------------- in process
def in_process(args, model, vocab: int) -> dict:
    engine = RolloutEngine(model, prefix_cache_tokens=args.prefix_cache_tokens,
                           prefill_chunk_tokens=args.prefill_chunk_tokens, prefill_graph_tokens=args.prefill_graph_tokens,
                           kv_cache_dtype=args.kv_cache_dtype)
    loop = EngineLoop(engine, max_rows=args.max_rows, idle_timeout_s=args.idle_timeout_s)

    async def call(prompt, max_tokens, temperature, first=None):
        """``first``: a list the time (``perf_counter``) its first token reached the host is appended to."""
        params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_tokens)
        listener = None if first is None else (lambda d: first.append(time.perf_counter()) if not first else None)
        [c] = await asyncio.wrap_future(loop.submit(prompt, params, listener=listener))
        return c.completion_ids.tolist()

    def run():
        return combine([asyncio.run(run_agents(args, vocab, call, range(args.agents), args.probe))])

    try:
        best = measure(args, run, lambda: dataclasses.asdict(loop.engine_stats()) | {"streams": loop.stats.streams}
                       | host_counters(loop.host_stats()),
                       (lambda: asyncio.run(probe_alone(args, vocab, call))) if args.probe else None)
        if args.profile:
            steps = loop.engine_stats().decode_steps
            best["profile"] = profiled(run, args.device)
            best["profile"]["decode_steps"] = loop.engine_stats().decode_steps - steps
        return best
    finally:
        loop.stop()


def profile_tables(prof) -> tuple[dict, dict, dict]:
    """A torch profile's ``{name: (ms, count)}`` tables: device kernels (device time; not the
    labelled ranges' spans), host operations (self time), and the ranges labelled
    ``treerl.<phase>`` (``profile_serve_phases.py``: inclusive host time)."""
    dev, host, phases = {}, {}, {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if not ev.key.startswith("treerl."):
                dev[ev.key] = (getattr(ev, "device_time_total", 0.0) / 1e3, ev.count)
        else:
            host[ev.key] = (ev.self_cpu_time_total / 1e3, ev.count)
            if ev.key.startswith("treerl."):
                phases[ev.key] = (ev.cpu_time_total / 1e3, ev.count)
    return dev, host, phases


def profiled(run, device: str) -> dict:
    """``run()`` under the torch profiler: wall and device-busy seconds, the top device kernels
    and host operations (self time), printed and returned."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        run()
    wall = time.perf_counter() - t0
    dev, host, phases = profile_tables(prof)
    out = {"wall_s": wall, "device_busy_s": sum(t for t, _ in dev.values()) / 1e3,
           "kernels": sum(c for _, c in dev.values()),
           "top_kernels_ms": dict(sorted(dev.items(), key=lambda kv: -kv[1][0])[:15]),
           "top_host_self_ms": dict(sorted(host.items(), key=lambda kv: -kv[1][0])[:25]),
           "phases_ms": dict(sorted(phases.items(), key=lambda kv: -kv[1][0]))}
    print(f"profiled run: wall {wall:.2f} s, device busy {out['device_busy_s']:.2f} s, {out['kernels']} kernels")
    for what in ("top_kernels_ms", "top_host_self_ms", "phases_ms"):
        for k, (ms, n) in out[what].items():
            print(f"  {what.removeprefix('top_').removesuffix('_ms'):10} {ms:9.1f} ms {n:7d}x  {k[:100]}")
    return out


# ---------------------------------------------------------------------- served
def save_model_dir(model, vocab: int, path: Path) -> None:
    """``model`` (``save_pretrained``) and a word-level tokenizer whose token ``i`` is the
    text ``str(i)`` (responses carry the ids written out), no special tokens, no EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


class ServerProcess:
    """``python -m treerl.cli serve`` on an ephemeral loopback port, until :meth:`stop`."""

    def __init__(self, args, model_dir: Path, dtype: str, log: Path):
        cmd = [sys.executable, "-m", "treerl.cli", "serve", "--weights", str(model_dir), "--device", args.device,
               "--dtype", dtype, "--port", "0", "--max-tokens", str(args.max_tokens),
               "--max-rows", str(args.max_rows), "--prefix-cache-tokens", str(args.prefix_cache_tokens),
               "--prefill-chunk-tokens", str(args.prefill_chunk_tokens), "--kv-cache-dtype", args.kv_cache_dtype,
               "--idle-timeout-s", str(args.idle_timeout_s)]
        if args.prefill_graph_tokens is not None:
            cmd.append(f"rollout.prefill_graph_tokens={args.prefill_graph_tokens}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        self.url = self._wait_for_url()

    def _wait_for_url(self, timeout: float = 600.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if "listening on " in line:
                    url = line.split("listening on ")[1].split()[0]
                    self.health(url)
                    return url
            if self.proc.poll() is not None:
                raise RuntimeError(f"treerl serve exited ({self.proc.returncode}):\n{self.log.read_text()}")
            time.sleep(0.2)  # polling a child's log for its start line, not synchronising our threads
        raise TimeoutError(f"treerl serve did not start in {timeout} s:\n{self.log.read_text()}")

    def health(self, url: str | None = None) -> dict:
        base = (url or self.url).removesuffix("/v1")
        with urllib.request.urlopen(f"{base}/health", timeout=60) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def client_agents(args, url: str, vocab: int, agents: range, start_at: float | None = None, probe: bool = False,
                  alone: bool = False, stop=None) -> dict:
    """:func:`run_agents` through ``openai.AsyncOpenAI`` (one client) against ``url``, from
    ``start_at`` (``time.monotonic``) on (``alone``: :func:`probe_alone` instead). Runs in a
    client process."""
    import openai

    from treerl.serve.client import http_module

    if start_at is not None:
        time.sleep(max(0.0, start_at - time.monotonic()))  # the client processes start together

    async def main():
        http = http_module()
        conns = 2 * len(agents) + 2  # the prober's too (and an alone run has no agents)
        limits = http.Limits(max_connections=conns, max_keepalive_connections=conns)
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=3600,
                                    http_client=http.AsyncClient(limits=limits, timeout=3600))

        async def call(prompt, max_tokens, temperature, first=None):  # (first token: not timed served)
            r = await client.completions.create(model="treerl", prompt=prompt, max_tokens=max_tokens,
                                                temperature=temperature)
            return r.choices[0].model_extra["token_ids"]

        try:
            if alone:
                return await probe_alone(args, vocab, call)
            return await run_agents(args, vocab, call, agents, probe, stop)
        finally:
            await client.close()

    return asyncio.run(main())


def served(args, server: ServerProcess, vocab: int) -> dict:
    """The agents in ``--client-procs`` processes (agent ``i`` in process ``i % procs``), the
    probe (``--probe``) in a process of its own: sharing one with agents, it waited for their
    requests' client CPU (the ``openai`` client: ~25 ms a long token-id prompt; session 15, H200:
    served probes of 0.4-0.87 s where the in-process ones took at most 0.18 s), which measures
    the client, not the server."""
    from concurrent.futures import ProcessPoolExecutor

    procs = max(1, min(args.client_procs, args.agents))
    shares = [range(k, args.agents, procs) for k in range(procs)]

    def counters() -> dict:
        health = server.health()
        return health["engine"] | {"streams": health["stats"]["streams"]} | host_counters(health["host"])

    alone = (lambda: client_agents(args, server.url, vocab, range(0), alone=True)) if args.probe else None
    if procs == 1 and not args.probe:
        return measure(args, lambda: combine([client_agents(args, server.url, vocab, shares[0])]), counters)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(procs + bool(args.probe), mp_context=spawn) as pool, spawn.Manager() as manager:
        def run() -> dict:
            stop = manager.Event()  # set when every agent has finished: the probe's process stops
            start_at = time.monotonic() + 0.25  # every client process ready (imports done in the untimed run)
            futures = [pool.submit(client_agents, args, server.url, vocab, share, start_at) for share in shares]
            prober = (pool.submit(client_agents, args, server.url, vocab, range(0), start_at, True, stop=stop)
                      if args.probe else None)
            try:
                parts = [f.result() for f in futures]
            finally:
                stop.set()
            return combine(parts, prober.result() if prober is not None else None)

        return measure(args, run, counters, alone)


# ---------------------------------------------------------------------- report
def summary(r: dict) -> str:
    c = r["engine"]
    per_round = c["admitted"] / max(c["admissions"], 1)
    rows = c["live_rows"] / max(c["decode_steps"], 1)
    return (f"{c['admissions']} admissions ({per_round:.1f} prompts each), {c['prefill_calls']} prefill calls "
            f"({c['prefill_graph_calls']} in fixed buckets, {c['prefill_graph_builds']} captured) "
            f"({c['prefill_tokens']} tokens computed, {c['prefix_cache_hit_tokens']} from the prefix cache), "
            f"{c['decode_steps']} decode steps ({rows:.1f} live rows each), {c['step_builds']} steps built, "
            f"{c['prefix_grows']} prompt-store growths, {c['reallocations']} reallocations, "
            f"{c['preemptions']} preemptions, {c['streams']} streams started")


def host_summary(r: dict) -> str:
    """The engine thread's time over the kept run: running, waiting for a CPU, and the rest
    (waiting for the GIL, the device or work); the garbage collector's passes (each holds the
    GIL: the engine thread stops)."""
    h, wall = r["host"], r["wall_s"]
    cpu, queued = h["engine_thread_cpu_s"], h["engine_thread_cpu_wait_s"]
    return (f"engine thread {cpu:.2f} s on a CPU, {queued:.2f} s waiting for one, {wall - cpu - queued:.2f} s "
            f"neither (GIL, device, idle) of {wall:.2f} s; the process's other Python threads "
            f"{h['other_threads_cpu_s']:.2f} s on a CPU (served: the HTTP server's event loop; in process: the agents' "
            f"clients); garbage collector {h['gc_passes']} passes "
            f"{h['gc_s']:.3f} s ({h['gc_full_passes']} full, {h['gc_full_s']:.3f} s)")


SERVED_NEEDS = ("fastapi", "uvicorn", "openai", "prometheus_client")  # the served mode's server and client


def missing_modules(names) -> list[str]:
    """Those of ``names`` that cannot be imported here."""
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def main(argv=None) -> dict:
    args = parse_args(argv)
    modes = args.modes.split(",")
    missing = missing_modules(SERVED_NEEDS) if "served" in modes else []
    if missing:  # (checked first: the in-process run before it would be lost)
        raise SystemExit(f"--modes served needs {', '.join(missing)}, not importable here: install treerl[serve], "
                         "or on a machine without a registry bring their wheels (bench/device/s13_call4.sh), or "
                         "leave served out of --modes")
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    context = args.prompt_len + args.turns * (args.max_tokens + args.tool_tokens) + 16
    model = build_model(args.family, args.shape, dtype=dtype, device=device, seed=args.seed,
                        max_position_embeddings=context)
    vocab = model.get_input_embeddings().num_embeddings
    print(f"treerl from {SRC}", flush=True)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                     "shape": args.shape, "dtype": dtype, "torch": torch.__version__, "treerl": str(SRC),
                     "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        if "served" in modes:
            save_model_dir(model, vocab, Path(tmp) / "model")
        if "in-process" in modes:
            results["in-process"] = in_process(args, model, vocab)
            print(f"in-process done: {results['in-process']['tok_s']:.1f} tok/s", flush=True)
            if args.json:  # (kept if the served run fails)
                args.json.write_text(json.dumps(results, indent=1))
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "served" in modes:
            server = ServerProcess(args, Path(tmp) / "model", dtype, args.server_log or Path(tmp) / "serve.log")
            print(f"treerl serve started: {server.url}", flush=True)
            try:
                results["served"] = served(args, server, vocab)
            finally:
                server.stop()
    per_call = (f"{args.min_tokens}-{args.max_tokens} new tokens/call at temperatures {args.temperatures}"
                if args.mixed else f"{args.max_tokens} new tokens/call")
    print(f"{args.agents} agents x {args.turns} turns, prompt {args.prompt_len} + {args.tool_tokens}/turn, "
          f"{per_call}, {args.shape} {dtype} on {results['device']}")
    print(f"{'mode':12} {'tok/s':>10} {'p50 s':>8} {'p99 s':>8} {'client CPU ms/request':>22}")
    for name in modes:
        r = results[name]
        cpu = f"{r['client_cpu_ms_per_request']:22.1f}" if name == "served" else f"{'-':>22}"
        print(f"{name:12} {r['tok_s']:10.1f} {r['latency_p50_s']:8.3f} {r['latency_p99_s']:8.3f} {cpu}")
    if len(modes) == 2:
        results["ratio"] = results["served"]["tok_s"] / results["in-process"]["tok_s"]
        print(f"{'ratio':12} {results['ratio']:10.3f}  (served / in-process)")
    if args.probe:
        print(f"short request ({args.probe_tokens} tokens after {args.probe_prompt_len}): latency alone vs "
              "behind the agents")
        for name in modes:
            r = results[name]
            if "probe_p50_s" not in r:
                print(f"{name:12} no probe finished while the agents ran")
                continue
            print(f"{name:12} alone p50 {r['probe_alone_p50_s']:.3f} s p99 {r['probe_alone_p99_s']:.3f} s; behind "
                  f"p50 {r['probe_p50_s']:.3f} s p99 {r['probe_p99_s']:.3f} s ({r['probes']} probes): "
                  f"x{r['probe_behind_over_alone_p50']:.2f} p50, x{r['probe_behind_over_alone_p99']:.2f} p99")
            if "probe_first_token_p50_s" in r and "probe_alone_first_token_p50_s" in r:
                print(f"{name:12} p50 first token alone {r['probe_alone_first_token_p50_s']:.4f} s, behind "
                      f"{r['probe_first_token_p50_s']:.4f} s; the rest alone {r['probe_alone_rest_p50_s']:.4f} s, "
                      f"behind {r['probe_rest_p50_s']:.4f} s")
            print(f"{name:12} slowest probes (start s after the run's start: latency s): "
                  + ", ".join(f"{p['start_s']:.2f}: {p['latency_s']:.3f}" for p in r["probe_slowest"]))
    for name in modes:
        print(f"{name}: {summary(results[name])}")
    for name in modes:
        print(f"{name}: {host_summary(results[name])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
