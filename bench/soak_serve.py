"""A bounded soak of ``treerl serve`` on loopback: mixed requests for a few minutes, then
checks that no request was lost or duplicated and that the server's memory is stable.

The server runs as its own process (this script with ``--serve``: a random-weight Qwen3
``--shape`` model with treerl's character tokenizer, behind an API key, small limits so that
refusals happen, bound to 127.0.0.1 only). ``--concurrency`` clients send, until
``--duration-s`` or ``--max-requests`` (whichever first), requests drawn from this mix
(seeded):

- ``completion``: a token-id prompt (random length), ``n`` in {1, 2, 4}, random
  ``max_tokens``; the response's ``prompt_token_ids`` must be the request's ids and it must
  have ``n`` choices (so a response that belongs to another request would be caught);
- ``chat``: one or two messages;
- ``disconnect``: a long generation the client abandons after ``--disconnect-after-s``;
- refusals, each of which must get its status: no API key (401), a body over the limit
  (413), ``n`` over the cap and ``max_tokens`` over the cap (400), a text prompt over the
  character bound (400, before tokenizing), a prompt beyond the context (400);
- ``reload``: ``/update_weights_from_disk`` of the weights under the weights root, the same
  weights (the version goes up under load).

429 (the admission bound, ``--max-queued`` below ``--concurrency``) is an allowed answer to
any generation request, refusals included (admission comes before parsing); the client
counts it and waits ``Retry-After`` before its next request.

Checks (exit 1 when one fails): every request got exactly one outcome; no generation request
is left in the server (``/health``: busy 0, requests = completed + failed); the server's
completed requests lie between the clients' successes and successes + abandoned ones; its
samples are at least the successes' choices (plus the warm-up's). Reported: counts per kind and outcome, latency
percentiles (successful completions and chats), the server's RSS after a warm-up and at the
end (``/proc/PID/status``), requests per second.

    python bench/soak_serve.py --duration-s 180 --json bench/results/soak_serve_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

KEY = "soak-key"
KINDS = {"completion": 40, "chat": 15, "disconnect": 8, "no_key": 5, "too_large": 5, "n_cap": 5, "tokens_cap": 5,
         "prompt_chars": 5, "context": 5, "reload": 2}


# ---------------------------------------------------------------------- server
def serve(args) -> None:
    import torch

    from treerl.models import build_model
    from treerl.rollout import RolloutEngine
    from treerl.serve import ServeOptions, ServerThread, make_state
    from treerl.serve.limits import ServeLimits
    from treerl.tasks.tokenizer import CharTokenizer

    torch.set_num_threads(args.threads)
    tok = CharTokenizer()
    model = build_model("qwen3", args.shape, seed=0, max_position_embeddings=args.context, **tok.hf_config_kwargs())
    root = Path(args.serve)
    model.save_pretrained(root / "weights", safe_serialization=True)
    limits = ServeLimits(max_n=4, max_tokens=48, max_body_bytes=32 << 10, max_queued=args.max_queued)
    state = make_state(RolloutEngine(model), tok, ServeOptions(default_max_tokens=16, limits=limits,
                                                                weights_root=str(root), max_rows=64))
    server = ServerThread(state, host="127.0.0.1", port=0, api_key=KEY).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    (root / "port").write_text(str(server.port))
    while not stop.wait(1.0):
        pass
    server.stop()


# ---------------------------------------------------------------------- clients
def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": v[-1], "count": len(v)}


async def one(h, url: str, kind: str, rng: random.Random, args, weights: str) -> tuple[str, float, int]:
    """Send one request of ``kind``; returns (outcome, seconds, choices)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    t = time.perf_counter()
    ctx = args.context
    if kind == "completion":
        ids = [rng.randrange(3, 90) for _ in range(rng.randrange(1, ctx // 2))]
        n = rng.choice([1, 2, 4])
        body = {"model": "treerl", "prompt": ids, "n": n, "max_tokens": rng.randrange(1, 24)}
        r = await h.post(url + "/v1/completions", json=body, headers=auth)
        if r.status_code == 200:
            out = r.json()
            if out["prompt_token_ids"] != ids or len(out["choices"]) != n:
                return "MISMATCH", time.perf_counter() - t, 0
            return "ok", time.perf_counter() - t, n
        return str(r.status_code), time.perf_counter() - t, 0
    if kind == "chat":
        msgs = [{"role": "user", "content": "".join(rng.choice("0123456789+=") for _ in range(rng.randrange(1, 40)))}
                for _ in range(rng.randrange(1, 3))]
        r = await h.post(url + "/v1/chat/completions", json={"model": "treerl", "messages": msgs, "max_tokens": 8},
                         headers=auth)
        if r.status_code == 200:
            return ("ok" if len(r.json()["choices"]) == 1 else "MISMATCH"), time.perf_counter() - t, 1
        return str(r.status_code), time.perf_counter() - t, 0
    if kind == "disconnect":
        body = {"model": "treerl", "prompt": [5] * 8, "n": 4, "max_tokens": 48, "temperature": 1.0}
        try:
            r = await asyncio.wait_for(h.post(url + "/v1/completions", json=body, headers=auth),
                                       args.disconnect_after_s)
            return ("finished_before_disconnect" if r.status_code == 200 else str(r.status_code)), \
                time.perf_counter() - t, 0
        except asyncio.TimeoutError:
            return "disconnected", time.perf_counter() - t, 0
    if kind == "reload":
        r = await h.post(url + "/update_weights_from_disk", json={"model_path": weights}, headers=auth)
        return ("ok" if r.status_code == 200 else str(r.status_code)), time.perf_counter() - t, 0
    body, headers = {"model": "treerl", "prompt": "1+1=", "max_tokens": 4}, auth
    if kind == "no_key":
        headers = {}
    elif kind == "too_large":
        body["prompt"] = "1" * (40 << 10)
    elif kind == "n_cap":
        body["n"] = 5
    elif kind == "tokens_cap":
        body["max_tokens"] = 49
    elif kind == "prompt_chars":
        body["prompt"] = "1" * (2 * ctx * 13 + 1)  # over the bound (2 x context x longest token): not tokenized
    elif kind == "context":
        body["prompt"] = "1" * (ctx + 5)  # within the character bound, beyond the context: tokenized, refused
    r = await h.post(url + "/v1/completions", json=body, headers=headers)
    return str(r.status_code), time.perf_counter() - t, 0


# admission comes before the request is parsed: any generation request may get 429
EXPECTED = {"no_key": {"401"}, "too_large": {"413"}, "n_cap": {"400", "429"}, "tokens_cap": {"400", "429"},
            "prompt_chars": {"400", "429"}, "context": {"400", "429"}, "completion": {"ok", "429"}, "chat": {"ok", "429"},
            "disconnect": {"disconnected", "finished_before_disconnect", "429"}, "reload": {"ok"}}


async def drive(args, url: str, weights: str, pid: int) -> dict:
    from treerl.serve.client import http_module

    http = http_module()
    rng = random.Random(args.seed)
    kinds, weights_ = zip(*KINDS.items())
    outcomes: dict[str, Counter] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    sent, choices = 0, 0
    issued: list[int] = []  # request numbers, to check each got exactly one outcome
    finished: Counter = Counter()
    limits = http.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with http.AsyncClient(timeout=120, limits=limits) as h:
        async def health():
            return (await h.get(url + "/health")).json()

        for _ in range(args.warmup):  # warm-up: allocator, first streams
            await one(h, url, "completion", rng, args, weights)
        rss_start = rss_kib(pid)
        t0 = time.perf_counter()
        deadline = t0 + args.duration_s

        async def worker(w: int):
            nonlocal sent, choices
            local = random.Random(args.seed * 1000 + w)
            while time.perf_counter() < deadline and sent < args.max_requests:
                number = sent
                sent += 1
                issued.append(number)
                kind = local.choices(kinds, weights_)[0]
                outcome, seconds, got = await one(h, url, kind, local, args, weights)
                finished[number] += 1
                outcomes[kind][outcome] += 1
                choices += got
                if outcome == "ok" and kind in ("completion", "chat"):
                    latency[kind].append(seconds)
                if outcome == "429":  # as the openai client does: wait Retry-After (the server's 1 s)
                    await asyncio.sleep(1.0)

        series = []  # (seconds, RSS KiB) every --rss-every-s: a plateau, not a climb

        async def sample_rss():
            while time.perf_counter() < deadline and sent < args.max_requests:
                series.append((round(time.perf_counter() - t0, 1), rss_kib(pid)))
                await asyncio.sleep(args.rss_every_s)

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
        sampler.cancel()
        wall = time.perf_counter() - t0
        # abandoned requests finish in the server: wait until it holds none (bounded)
        for _ in range(600):
            state = await health()
            if state["busy_requests"] == 0:
                break
            await asyncio.sleep(0.1)
        rss_end = rss_kib(pid)
    stats = state["stats"]
    ok = sum(c["ok"] for k, c in outcomes.items() if k in ("completion", "chat"))
    abandoned = sum(c["disconnected"] for c in outcomes.values())
    problems = []
    if sorted(finished) != sorted(issued) or any(v != 1 for v in finished.values()):
        problems.append("a request without exactly one outcome")
    for kind, counter in outcomes.items():
        bad = {o: c for o, c in counter.items() if o not in EXPECTED[kind]}
        if bad:
            problems.append(f"{kind}: unexpected outcomes {bad}")
    if state["busy_requests"] != 0:
        problems.append(f"{state['busy_requests']} requests still in the server")
    if stats["requests"] != stats["completed"] + stats["failed"]:
        problems.append(f"server: requests {stats['requests']} != completed {stats['completed']} + failed {stats['failed']}")
    if not ok <= stats["completed"] - args.warmup <= ok + abandoned + sum(c["finished_before_disconnect"] for c in outcomes.values()):
        problems.append(f"server completed {stats['completed'] - args.warmup} vs clients' {ok} ok + {abandoned} abandoned")
    if stats["samples"] < choices + args.warmup:
        problems.append(f"server returned {stats['samples']} samples, clients received {choices} + warm-up")
    return {"requests": sent, "wall_s": wall, "requests_per_s": sent / wall,
            "outcomes": {k: dict(v) for k, v in sorted(outcomes.items())},
            "latency_s": {k: percentiles(v) for k, v in latency.items()},
            "choices_received": choices, "server": stats, "weight_version": state["weight_version"],
            "rss_kib": {"after_warmup": rss_start, "end": rss_end, "growth": rss_end - rss_start, "series": series},
            "problems": problems}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--max-requests", type=int, default=50000)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--max-queued", type=int, default=16, help="the server's admission bound (429 above it)")
    p.add_argument("--disconnect-after-s", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rss-every-s", type=float, default=30.0)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="treerl-soak-") as tmp:
        cmd = [sys.executable, __file__, "--serve", tmp, "--shape", args.shape, "--context", str(args.context),
               "--threads", str(args.threads), "--max-queued", str(args.max_queued)]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            port_file = Path(tmp) / "port"
            for _ in range(1200):  # the server writes its port once it listens (bounded wait)
                if port_file.exists() or proc.poll() is not None:
                    break
                time.sleep(0.1)
            if not port_file.exists():
                raise SystemExit("the soak server did not start")
            url = f"http://127.0.0.1:{port_file.read_text()}"
            result = asyncio.run(drive(args, url, str(Path(tmp) / "weights"), proc.pid))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "serve")}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if result["problems"]:
        print("SOAK FAILED: " + "; ".join(result["problems"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
