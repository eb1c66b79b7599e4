"""Where ``treerl serve``'s process spends host time per request outside the engine thread.

Issue 23: served / in-process throughput is 0.867 on the H100 (target >= 0.9). The engine's
decode loop is host-bound and runs in a thread of the server process; everything else the
server does per request (HTTP parsing, validation, templating, tokenizing, token-exact
histories, detokenizing, JSON / SSE) runs in the same process and takes the GIL from it.
This tool measures that work, on the CPU: a real server (:class:`treerl.serve.ServerThread`,
uvicorn on loopback, a tiny Qwen3 with random weights) driven by ``openai.AsyncOpenAI``
agents in ``--client-procs`` other processes (their CPU is not the server's), as
``bench/bench_serve.py`` does.

- ``--api completions`` (bench_serve.py's requests): ``/v1/completions`` with ``prompt`` as
  ``--prompt-len`` token ids, the next turn's prompt = prompt + completion + ``--tool-tokens``
  ids; a word-level tokenizer whose token ``i`` is ``str(i)`` and a ``--vocab`` of 151,936 (Qwen's:
  the ids' JSON is as long as on the GPU run).
- ``--api chat``: ``/v1/chat/completions`` with a growing conversation (a system message, a
  user message of about ``--prompt-len`` tokens of English text, then per turn the reply and a
  user message of about ``--tool-tokens`` tokens), a byte-level BPE tokenizer trained here
  (``--bpe-vocab``) and the ChatML template of ``tests/helpers/chat.py`` (Qwen-like); the
  token-exact history is on, as served.
- ``--stream``: the same requests with ``stream=true`` (server-sent events).

Reported per request (the timed run, after an untimed one): **CPU milliseconds of each thread
group of the server process** (the event loop's thread, the worker threads the handlers hand
work to, the engine thread; per-thread CPU clocks), split into user time (Python, holding the
GIL, except in native code that releases it) and system time (socket and epoll calls, which
run without the GIL), from ``/proc``; and **per stage** (thread CPU time, exclusive of nested
stages): the handler functions wrapped with timers; "HTTP/ASGI/asyncio" is the event loop
thread's time outside every stage (uvicorn's h11 parser, Starlette / FastAPI routing and
middleware, asyncio). ``--cprofile``: also the event loop thread's self time by package under cProfile (its overhead inflates pure-Python code, roughly 2x).

Run (CPU; 2 client processes; the figures are this machine's):
    PYTHONPATH=src python bench/profile_serve_host.py --api completions
    PYTHONPATH=src python bench/profile_serve_host.py --api chat
    PYTHONPATH=src python bench/profile_serve_host.py --api chat --stream
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import functools
import json
import multiprocessing
import os
import pstats
import random
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("TREERL_SRC", str(ROOT / "src")))  # (TREERL_SRC: another checkout's, to compare)
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from treerl.models import build_model  # noqa: E402
from treerl.rollout import RolloutEngine  # noqa: E402
from treerl.serve import ServeOptions, ServerThread, make_state  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1024, help="first turn's prompt, in tokens (chat: about)")
    p.add_argument("--tool-tokens", type=int, default=64, help="tokens added per turn besides the reply")
    p.add_argument("--max-tokens", type=int, default=8, help="per call (small: the engine stays cheap)")
    p.add_argument("--vocab", type=int, default=151936, help="completions: the model's vocabulary")
    p.add_argument("--bpe-vocab", type=int, default=16384, help="chat: the trained BPE's vocabulary")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="timed runs (stage timers summed over them)")
    p.add_argument("--emulated-engine", action="store_true",
                   help="an always-busy host-bound stand-in for the engine: its blocked time is what the server's "
                        "other threads take of the GIL")
    p.add_argument("--engine-ops", type=int, default=200, help="--emulated-engine: torch operations per step")
    p.add_argument("--cprofile", action="store_true", help="one more run with the server threads under cProfile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------------- tokenizers
def word_tokenizer(vocab: int):
    """bench_serve.py's: token ``i`` is the text ``str(i)``, no special tokens, no eos."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def corpus_lines() -> list[str]:
    """English-ish text to train the BPE on and to write messages from: this repository's
    documentation and Python sources."""
    lines = []
    for path in sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("src/treerl/**/*.py")]):
        lines += [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines


def chat_tokenizer(vocab: int):
    """A byte-level BPE (Qwen-like pre-tokenizer) trained on :func:`corpus_lines`, with
    ChatML specials and the Qwen-like template of ``tests/helpers/chat.py``."""
    from helpers.chat import TEMPLATE
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = TEMPLATE
    return out


# ---------------------------------------------------------------------- stage timers
class Stages:
    """Thread CPU time of wrapped functions, exclusive of the wrapped functions they call,
    per stage name (any thread but the engine's)."""

    def __init__(self):
        self.ns = collections.Counter()
        self.calls = collections.Counter()
        self.local = threading.local()
        self.lock = threading.Lock()

    def wrap(self, owner, name: str, label: str) -> None:
        f = getattr(owner, name)
        if asyncio.iscoroutinefunction(f):
            raise TypeError(f"{name}: a coroutine function's thread time is not its own")
        stages = self

        @functools.wraps(f)
        def timed(*a, **k):
            stack = getattr(stages.local, "stack", None)
            if stack is None:
                stack = stages.local.stack = []
            t = time.thread_time_ns()
            if stack:  # the caller's stage stops counting
                stack[-1][1] += t - stack[-1][0]
            stack.append([t, 0, label])
            try:
                return f(*a, **k)
            finally:
                t2 = time.thread_time_ns()
                start, acc, _ = stack.pop()
                with stages.lock:
                    stages.ns[label] += acc + t2 - start
                    stages.calls[label] += 1
                if stack:
                    stack[-1][0] = t2

        setattr(owner, name, timed)

    def clear(self) -> None:
        with self.lock:
            self.ns.clear()
            self.calls.clear()


def install_stages(state) -> Stages:
    """The handler path's stages (module globals and methods, patched before any request)."""
    from starlette.responses import JSONResponse

    from treerl.serve import app, chat, choices, detok, history, requests, streaming

    s = Stages()
    chat_r = state.chat
    for owner, name, label in [
        (app, "parse_request", "parse + validate (pydantic)"),
        (app, "completion_prompts", "prompt ids + checks"),
        (app, "check_ids", "prompt ids + checks"),
        (app, "sampling_params", "sampling params"),
        (streaming, "sampling_params", "sampling params"),
        (requests, "submit", "submit to the engine loop"),
        (streaming, "submit", "submit to the engine loop"),
        (app, "completion_body", "response body"),
        (chat, "template_messages", "chat: messages -> template dicts"),
        (chat, "render_chat", "chat: template (jinja)"),
        (chat, "conversation_keys", "chat: history keys (hash)"),
        (history, "conversation_keys", "chat: history keys (hash)"),
        (history.TokenHistory, "prompt_ids", "chat: token-exact history"),
        (history.TokenHistory, "record", "chat: history record"),
        (chat.ChatRenderer, "_encode", "chat: tokenize"),
        (chat.ChatRenderer, "reply", "chat: reply (tool parse)"),
        (choices, "chat_choice", "response body"),
        (choices, "response_body", "response body"),
        (app, "chat_choice", "response body"),  # (app.py's own references)
        (app, "response_body", "response body"),
        (choices, "choice_text", "detokenize"),
        (streaming, "choice_text", "detokenize"),
        (detok.TextStream, "push", "detokenize (stream)"),
        (streaming, "_sse", "SSE json"),
        (JSONResponse, "render", "response JSON (json.dumps)"),
    ]:
        s.wrap(owner, name, label)
    # the decoder is a closure made at construction: wrap the instance's
    dec = chat_r._decode
    holder = type("H", (), {"f": staticmethod(dec)})
    s.wrap(holder, "f", "chat: history decode")
    chat_r._decode = holder.f
    return s


# ---------------------------------------------------------------------- an emulated engine
class EmulatedEngineLoop:
    """A stand-in for :class:`treerl.serve.EngineLoop` (``--emulated-engine``) whose thread
    emulates a GPU engine's host-bound decode loop: it never idles, and each step runs
    ``ops`` small torch operations (each releases the GIL around its kernel, as a CUDA launch
    does) and gives every live row one token (random ids; deltas to streaming listeners every
    8 steps, as the engine's host syncs). What the server's other threads take of the GIL
    shows as time this thread spends blocked (:func:`engine_blocked`)."""

    def __init__(self, vocab: int, max_positions: int, ops: int = 200, seed: int = 0):
        from types import SimpleNamespace

        from treerl.rollout import RolloutStats
        from treerl.serve.loop import LoopStats

        self.engine = SimpleNamespace(vocab_size=vocab, max_positions=max_positions, version=0,
                                      logit_dtype=torch.float32, stats=RolloutStats())
        self.stats, self._engine_stats = LoopStats(), RolloutStats()
        self.ops, self.rng = ops, random.Random(seed)
        self.steps = 0
        self._cond = threading.Condition()
        self._pending, self._live = [], []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="treerl-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, prompt, params, *, listener=None):
        from concurrent.futures import Future

        params.validate(self.engine.vocab_size)
        fut = Future()
        with self._cond:
            self.stats.requests += 1
            self._pending.append({"prompt": list(prompt), "params": params, "future": fut, "listener": listener,
                                  "rows": [[] for _ in range(params.n)], "sent": [0] * params.n})
        return fut

    def cancel(self, future) -> None:
        pass

    def engine_stats(self):
        return self._engine_stats

    @property
    def busy(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._live)

    def drain(self, timeout=None) -> bool:
        return True

    def stop(self, timeout=10.0) -> None:
        with self._cond:
            self._stopped = True
        self._thread.join(timeout)

    def _run(self) -> None:
        from treerl.rollout import Completion
        from treerl.rollout.types import TokenDelta

        x = torch.zeros(16)
        while True:
            with self._cond:
                if self._stopped:
                    return
                self._live += self._pending
                self._pending = []
                live = list(self._live)
            for _ in range(self.ops):
                x.add_(1.0)
            self.steps += 1
            sync = self.steps % 8 == 0
            done = []
            for r in live:
                p = r["params"]
                finished = True
                for j, row in enumerate(r["rows"]):
                    if len(row) < p.max_new_tokens:
                        row.append(self.rng.randrange(self.engine.vocab_size))
                        finished = finished and len(row) == p.max_new_tokens
                    if r["listener"] is not None and (sync or len(row) == p.max_new_tokens) and r["sent"][j] < len(row):
                        new = row[r["sent"][j]:]
                        r["sent"][j] = len(row)
                        r["listener"](TokenDelta(0, (j,), new, [-1.0] * len(new), [0] * len(new), None,
                                                 "length" if len(row) == p.max_new_tokens else None))
                if finished:
                    done.append(r)
            if done:
                with self._cond:
                    self._live = [r for r in self._live if r not in done]
                for r in done:
                    prompt = torch.tensor(r["prompt"], dtype=torch.int64)
                    out = [Completion(0, prompt, torch.tensor(row, dtype=torch.int64),
                                      torch.full((len(row),), -1.0), torch.zeros(len(row), dtype=torch.int64),
                                      "length", None, (j,)) for j, row in enumerate(r["rows"])]
                    self.stats.completed += 1
                    r["future"].set_result(out)


def schedstat(tid: int) -> tuple[float, float]:
    """(on-CPU seconds, seconds waiting for a CPU) of thread ``tid``."""
    run, wait, _ = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
    return int(run) / 1e9, int(wait) / 1e9


# ---------------------------------------------------------------------- garbage collection
class GCTimes:
    """Wall time of the cyclic garbage collector's passes (they hold the GIL throughout), per
    generation and per thread group that triggered them."""

    def __init__(self):
        self.start = None
        self.seconds = collections.Counter()
        self.count = collections.Counter()
        self.collected = collections.Counter()
        self.on = False
        import gc
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if not self.on:
            return
        if phase == "start":
            self.start = time.perf_counter()
            return
        if self.start is None:
            return
        name = threading.current_thread().name
        key = (info["generation"], "engine" if name == "treerl-engine-loop" else "server")
        self.seconds[key] += time.perf_counter() - self.start
        self.count[key] += 1
        self.start = None


# ---------------------------------------------------------------------- thread CPU
def thread_groups() -> dict[int, str]:
    """native thread id -> group (event loop, workers, engine, main, native: threads Python
    does not know, e.g. torch's)."""
    out = {}
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        if t.name == "treerl-serve":
            g = "event loop (uvicorn)"
        elif t.name == "treerl-engine-loop":
            g = "engine thread"
        elif t is threading.main_thread():
            g = "main (this tool)"
        elif "AnyIO" in t.name or "worker" in t.name.lower():
            g = "worker threads (run_in_threadpool)"
        else:
            g = f"other: {t.name}"
        out[t.native_id] = g
    return out


def cpu_by_thread() -> dict[int, tuple[float, float]]:
    """native thread id -> (user s, system s) of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def thread_clocks() -> dict[int, float]:
    """native thread id -> CPU seconds (ns resolution) of each Python thread."""
    out = {}
    for t in threading.enumerate():
        try:
            out[t.native_id] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):
            pass
    return out


def cpu_by_group(before: dict, after: dict) -> dict[str, list[float]]:
    groups = thread_groups()
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for tid, (u, s) in after.items():
        u0, s0 = before.get(tid, (0.0, 0.0))
        g = groups.get(tid, "native (torch, no GIL)")
        out[g][0] += u - u0
        out[g][1] += s - s0
    return dict(out)


# ---------------------------------------------------------------------- clients
def _text(rng: random.Random, lines: list[str], tokens: int) -> str:
    out, chars = [], 0
    while chars < 4 * tokens:  # about 4 characters a token
        ln = lines[rng.randrange(len(lines))]
        out.append(ln)
        chars += len(ln) + 1
    return "\n".join(out)


def client(args, url: str, agents: range, start_at: float, lines: list[str] | None) -> dict:
    import openai

    from treerl.serve.client import http_module

    time.sleep(max(0.0, start_at - time.monotonic()))  # the client processes start together

    async def main():
        http = http_module()
        limits = http.Limits(max_connections=2 * len(agents) + 2, max_keepalive_connections=2 * len(agents) + 2)
        c = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=600,
                               http_client=http.AsyncClient(limits=limits, timeout=600))
        latencies, tokens = [], 0

        async def completions(prompt, rng):
            if not args.stream:
                r = await c.completions.create(model="treerl", prompt=prompt, max_tokens=args.max_tokens,
                                               temperature=1.0)
                return r.choices[0].model_extra["token_ids"]
            ids = []
            async for ch in await c.completions.create(model="treerl", prompt=prompt, max_tokens=args.max_tokens,
                                                       temperature=1.0, stream=True):
                for choice in ch.choices:
                    ids += choice.model_extra.get("token_ids") or []
            return ids

        async def chat(messages):
            if not args.stream:
                r = await c.chat.completions.create(model="treerl", messages=messages, max_tokens=args.max_tokens,
                                                    temperature=1.0)
                return r.choices[0].message.content or "", r.choices[0].model_extra["token_ids"]
            text, ids = [], []
            async for ch in await c.chat.completions.create(model="treerl", messages=messages,
                                                            max_tokens=args.max_tokens, temperature=1.0,
                                                            stream=True):
                for choice in ch.choices:
                    text.append(choice.delta.content or "")
                    ids += choice.model_extra.get("token_ids") or []
            return "".join(text), ids

        async def agent(i):
            nonlocal tokens
            rng = random.Random(args.seed * 1000 + i)
            if args.api == "completions":
                prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
            else:
                messages = [{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": _text(rng, lines, args.prompt_len)}]
            for _ in range(args.turns):
                t = time.perf_counter()
                if args.api == "completions":
                    ids = await completions(prompt, rng)
                    prompt = prompt + ids + [rng.randrange(args.vocab) for _ in range(args.tool_tokens)]
                else:
                    text, ids = await chat(messages)
                    messages = messages + [{"role": "assistant", "content": text},
                                           {"role": "user", "content": _text(rng, lines, args.tool_tokens)}]
                latencies.append(time.perf_counter() - t)
                tokens += len(ids)

        t0 = time.monotonic()
        try:
            await asyncio.gather(*(agent(i) for i in agents))
        finally:
            await c.close()
        return {"latencies": latencies, "tokens": tokens, "start": t0, "end": time.monotonic()}

    return asyncio.run(main())


# ---------------------------------------------------------------------- profile of the server threads
class LoopProfile:
    """cProfile in the event loop's thread (a profile is per thread: it is started and stopped
    there, through ``call_soon_threadsafe``)."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop, self.profile = aloop, cProfile.Profile()

    def _in_loop(self, f) -> None:
        done = threading.Event()

        def call():
            try:
                f()
            finally:
                done.set()

        self.aloop.call_soon_threadsafe(call)
        done.wait()

    def start(self) -> None:
        self._in_loop(self.profile.enable)

    def stop(self) -> pstats.Stats:
        self._in_loop(self.profile.disable)
        return pstats.Stats(self.profile)


def by_package(stats: pstats.Stats) -> list[tuple[str, float, int]]:
    out = collections.Counter()
    calls = collections.Counter()
    for (file, _, func), (_, nc, tt, _, _) in stats.stats.items():
        if file == "~":
            key = f"builtin {func}"[:60]
        elif "site-packages" in file:
            key = file.split("site-packages/")[1].split("/")[0]
        elif "/treerl/" in file:
            key = "treerl." + file.split("/treerl/")[1].replace("/", ".").removesuffix(".py")
        elif "/lib/python" in file:
            key = "stdlib " + file.split("/lib/python")[1].split("/", 1)[1].split("/")[0].removesuffix(".py")
        else:
            key = file
        out[key] += tt
        calls[key] += nc
    return [(k, v, calls[k]) for k, v in out.most_common()]


# ---------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    if args.api == "completions":
        tok = word_tokenizer(args.vocab)
        vocab, eos = args.vocab, None
    else:
        tok = chat_tokenizer(args.bpe_vocab)
        vocab, eos = len(tok), tok.eos_token_id
    context = args.prompt_len * 3 + args.turns * (args.max_tokens + 2 * args.tool_tokens) + 512
    model = build_model("qwen3", "tiny", dtype=torch.float32, vocab_size=vocab, max_position_embeddings=context,
                        eos_token_id=eos, seed=args.seed)
    model.train(False)
    engine = RolloutEngine(model, prefix_cache_tokens=1 << 18)
    state = make_state(engine, tok, ServeOptions(default_max_tokens=args.max_tokens, idle_timeout_s=30.0))
    if args.emulated_engine:
        state.loop.stop()
        state.loop = EmulatedEngineLoop(vocab, context, args.engine_ops, args.seed)
    stages = install_stages(state)
    gct = GCTimes()
    server = ServerThread(state).start()
    lines = corpus_lines() if args.api == "chat" else None
    procs = max(1, min(args.client_procs, args.agents))
    shares = [range(k, args.agents, procs) for k in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    results = {"settings": {k: str(v) for k, v in vars(args).items()}}
    try:
        with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            def run() -> dict:
                start_at = time.monotonic() + 0.5
                futures = [pool.submit(client, args, server.url, share, start_at, lines) for share in shares]
                parts = [f.result() for f in futures]
                lat = sorted(x for p in parts for x in p["latencies"])
                wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
                return {"requests": len(lat), "tokens": sum(p["tokens"] for p in parts), "wall_s": wall,
                        "latency_p50_s": lat[len(lat) // 2]}

            run()  # untimed: imports, first stream, allocator
            stages.clear()
            gct.on = True
            etid = state.loop._thread.native_id
            steps0, sched0, wall0 = getattr(state.loop, "steps", 0), schedstat(etid), time.perf_counter()
            before, clocks0 = cpu_by_thread(), thread_clocks()
            runs = [run() for _ in range(args.repeats)]
            after, clocks1 = cpu_by_thread(), thread_clocks()
            steps1, sched1, wall1 = getattr(state.loop, "steps", 0), schedstat(etid), time.perf_counter()
            if args.emulated_engine:  # the same window with no requests: the engine's own figures
                idle_s = min(5.0, wall1 - wall0)
                s0, w0, i0 = schedstat(etid), time.perf_counter(), state.loop.steps
                threading.Event().wait(idle_s)  # (a measuring window, not a synchronisation)
                s1, w1, i1 = schedstat(etid), time.perf_counter(), state.loop.steps
                idle = {"step_ms": 1000 * (w1 - w0) / max(i1 - i0, 1),
                        "blocked_share": ((w1 - w0) - (s1[0] - s0[0]) - (s1[1] - s0[1])) / (w1 - w0)}
            gct.on = False
            requests = sum(r["requests"] for r in runs)
            groups = cpu_by_group(before, after)
            precise = collections.Counter()
            names = thread_groups()
            for tid, c in clocks1.items():
                precise[names.get(tid, "?")] += c - clocks0.get(tid, 0.0)
            stage_ns, stage_calls = dict(stages.ns), dict(stages.calls)
            prof = None
            if args.cprofile:
                lp = LoopProfile(_event_loop())
                lp.start()
                run()
                prof = lp.stop()
        results["chat_history"] = state.chat.history.stats.snapshot()
    finally:
        server.stop()
    results["runs"] = runs
    results["requests"] = requests
    results["threads_ms_per_request"] = {g: {"cpu": 1000 * precise.get(g, u + s) / requests,
                                             "user": 1000 * u / requests, "system": 1000 * s / requests}
                                         for g, (u, s) in sorted(groups.items())}
    results["gc_ms_per_request"] = {f"gen{g} in {who}": {"ms": 1000 * v / requests,
                                                         "passes": gct.count[(g, who)] / requests}
                                    for (g, who), v in sorted(gct.seconds.items())}
    wall = wall1 - wall0
    on_cpu, queued = sched1[0] - sched0[0], sched1[1] - sched0[1]
    blocked = wall - on_cpu - queued
    results["engine_thread"] = {"wall_s": wall, "on_cpu_s": on_cpu, "waiting_for_cpu_s": queued,
                                "blocked_s": blocked, "blocked_ms_per_request": 1000 * blocked / requests}
    if args.emulated_engine:
        results["engine_thread"] |= {"steps": steps1 - steps0, "step_ms": 1000 * wall / max(steps1 - steps0, 1),
                                     "idle": idle}
    results["stages_ms_per_request"] = {k: 1e-6 * v / requests for k, v in sorted(stage_ns.items(), key=lambda kv: -kv[1])}
    results["stage_calls"] = stage_calls
    server_threads = {g: v for g, v in groups.items() if g.startswith(("event loop", "worker"))}
    server_ms = 1000 * sum(precise.get(g, 0.0) for g in server_threads) / requests
    staged = 1e-6 * sum(stage_ns.values()) / requests
    results["server_ms_per_request"] = server_ms
    results["staged_ms_per_request"] = staged
    print(f"{args.api}{' stream' if args.stream else ''}: {args.agents} agents x {args.turns} turns, prompt "
          f"{args.prompt_len} + {args.tool_tokens}/turn tokens, {args.max_tokens} new tokens/call, "
          f"{procs} client processes; {requests} timed requests, "
          f"{' / '.join(format(r['wall_s'], '.2f') for r in runs)} s")
    print(f"{'thread group':40} {'CPU ms/req':>12} {'user':>8} {'sys':>8}  (user/sys: 10 ms ticks)")
    for g, v in results["threads_ms_per_request"].items():
        print(f"{g:40} {v['cpu']:12.3f} {v['user']:8.2f} {v['system']:8.2f}")
    print(f"server threads (event loop + workers): {server_ms:.3f} ms/request")
    if args.api == "chat":
        print("token-exact history:", results["chat_history"])
    for k, v in results["gc_ms_per_request"].items():
        print(f"garbage collection {k:20} {v['ms']:8.3f} ms/request ({v['passes']:.2f} passes/request)")
    e = results["engine_thread"]
    print(f"engine thread over the timed runs: {e['wall_s']:.2f} s wall, on a CPU {e['on_cpu_s']:.2f} s, waiting "
          f"for a CPU {e['waiting_for_cpu_s']:.2f} s, blocked {e['blocked_s']:.2f} s = "
          f"{e['blocked_ms_per_request']:.3f} ms/request (emulated engine: the GIL; the real one also its own waits)")
    if args.emulated_engine:
        print(f"emulated engine: {e['step_ms']:.3f} ms/step under load; alone {e['idle']['step_ms']:.3f} ms/step, "
              f"blocked {100 * e['idle']['blocked_share']:.1f}% of the time")
    print(f"{'stage (thread CPU, exclusive)':40} {'ms/req':>8} {'calls/req':>10}")
    for k, v in results["stages_ms_per_request"].items():
        print(f"{k:40} {v:8.3f} {stage_calls[k] / requests:10.2f}")
    print(f"{'(staged total)':40} {staged:8.3f}")
    print(f"{'HTTP/ASGI/asyncio (rest)':40} {server_ms - staged:8.3f}")
    if prof is not None:
        rows = by_package(prof)
        total = sum(v for _, v, _ in rows)
        print(f"cProfile of the event loop thread (one run of {requests // args.repeats} requests): self time by package")
        for k, v, n in rows[:25]:
            print(f"  {k:60} {1000 * v / (requests / args.repeats):8.3f} ms/req {n / (requests / args.repeats):9.1f} calls/req")
        print(f"  {'total':60} {1000 * total / (requests / args.repeats):8.3f} ms/req")
        results["cprofile_ms_per_request"] = {k: 1000 * v / (requests / args.repeats) for k, v, _ in rows[:40]}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


def _event_loop():
    """The uvicorn thread's running asyncio loop."""
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running():
            return obj
    raise RuntimeError("no running event loop")


if __name__ == "__main__":
    main()
