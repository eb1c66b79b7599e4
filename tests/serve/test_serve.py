"""treerl serve, driven by the `openai` package over loopback (a real uvicorn server on an
ephemeral port, no mocks): API, token ids / logprobs / versions, bad requests, weight
updates mid-generation, a server stopped mid-request, 64 concurrent agents.

Synchronisation is by events and readiness (the socket is bound before the server starts,
so connections queue until it serves), never by sleeping."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import sys
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
import torch

from helpers.models import tiny_model
from helpers.serve import CONTEXT, served_config
from treerl.serve.client import http_module
from treerl.checkpoint import save_checkpoint
from treerl.rollout import RolloutEngine
from treerl.serve import ServeOptions, ServerThread, make_state
from treerl.models import build_model
from treerl.tasks.tokenizer import CharTokenizer

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = CharTokenizer()
    engine = RolloutEngine(tiny_model(**served_config(tok)), prefix_cache_tokens=4096)
    root = str(tmp_path_factory.getbasetemp())  # reloads from the tests' tmp_path
    server = ServerThread(make_state(engine, tok, ServeOptions(default_max_tokens=8, weights_root=root))).start()
    engine._test_loop = server.state.loop
    yield server, engine, tok
    server.stop()


def client(server: ServerThread, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key="x", **kw)


def greedy_text_without_eos(engine, tok, n_tokens: int, plain: bool = False) -> list[int]:
    """A prompt whose greedy continuation has no eos (``plain``: no special token) in its
    first ``n_tokens`` (random weights: found by trying prompts)."""
    from treerl.rollout import SamplingParams

    served_loop = getattr(engine, "_test_loop", None)
    if served_loop is not None:
        served_loop.drain()  # no stream of the server may be open while generate runs on the engine
    for i in range(200):
        prompt = tok.encode(f"q{i}?", add_special_tokens=True)
        ids = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=n_tokens))[0][0].completion_ids
        if (min(ids.tolist()) >= len(tok.special_tokens)) if plain else tok.eos_token_id not in ids.tolist():
            return prompt
    raise AssertionError("no such prompt found")


def test_openai_client_drives_treerl_serve(served):
    server, engine, tok = served

    async def main():
        c = client(server)
        r = await c.completions.create(model="treerl", prompt="12+7=", max_tokens=6, n=3, logprobs=0)
        assert len(r.choices) == 3
        prompt = r.model_extra["prompt_token_ids"]
        assert prompt == tok.encode("12+7=", add_special_tokens=True)
        # token ids in: the same prompt as ids
        r2 = await c.completions.create(model="treerl", prompt=prompt, max_tokens=6, temperature=0)
        r3 = await c.completions.create(model="treerl", prompt=prompt, max_tokens=6, extra_body={"top_k": 1})
        assert r2.choices[0].model_extra["token_ids"] == r3.choices[0].model_extra["token_ids"]  # greedy == top-k 1
        chat = await c.chat.completions.create(model="treerl", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, logprobs=True)
        assert chat.model_extra["prompt_token_ids"] == [tok.bos_token_id, tok.user_token_id, *tok.encode("hi"),
                                                        tok.assistant_token_id]
        assert len(chat.choices[0].logprobs.content) == len(chat.choices[0].model_extra["token_ids"])
        models = await c.models.list()
        assert [m.id for m in models.data] == ["treerl"]
        return r, prompt

    r, prompt = asyncio.run(main())
    server.state.loop.drain()  # the model is the engine's: no stream may be open while we call it
    # behaviour logprobs and text agree with the model (an independent teacher-forced forward)
    for choice in r.choices:
        x = choice.model_extra
        ids = x["token_ids"]
        assert len(ids) == len(x["token_logprobs"]) == len(x["token_versions"]) == len(choice.logprobs.token_logprobs)
        assert set(x["token_versions"]) == {engine.version}
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + ids])).logits[0].double()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert np.allclose(x["token_logprobs"], expected.numpy(), atol=1e-4)
        assert choice.text == tok.decode(ids, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if ids[-1] == tok.eos_token_id else "length")


def test_in_process_client_has_the_same_api():
    from treerl.serve import in_process_client

    tok = CharTokenizer()
    state = make_state(RolloutEngine(tiny_model(**served_config(tok))), tok)

    async def main():
        c = in_process_client(state)
        r = await c.chat.completions.create(model="treerl", messages=[{"role": "user", "content": "2*3"}],
                                            max_tokens=3, n=2)
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="treerl", messages=[], max_tokens=3)
        return r

    try:
        r = asyncio.run(main())
    finally:
        state.loop.stop()
    assert len(r.choices) == 2 and all(ch.model_extra["token_ids"] for ch in r.choices)


def test_stop_token_ids_and_stop_strings(served):
    server, engine, tok = served
    prompt = greedy_text_without_eos(engine, tok, 6, plain=True)

    async def main():
        c = client(server)
        g = await c.completions.create(model="treerl", prompt=prompt, max_tokens=6, temperature=0)
        ids = g.choices[0].model_extra["token_ids"]
        s = await c.completions.create(model="treerl", prompt=prompt, max_tokens=6, temperature=0,
                                       extra_body={"stop_token_ids": [ids[2]]})
        assert s.choices[0].model_extra["token_ids"] == ids[: ids.index(ids[2]) + 1]
        assert s.choices[0].finish_reason == "stop"
        stop = tok.decode(ids[1:3])
        t = await c.completions.create(model="treerl", prompt=prompt, max_tokens=6, temperature=0, stop=[stop])
        text = tok.decode(ids)
        assert t.choices[0].text == text[: text.find(stop)] and t.choices[0].model_extra["stop_reason"] == stop

    asyncio.run(main())


BAD = [  # (body or raw bytes, status, param)
    (b'{"model": "treerl", "prompt": "1+1=", ', 400, "body"),
    ({"model": "gpt-4", "prompt": "1+1="}, 404, "model"),
    ({"model": "treerl"}, 400, "prompt"),
    ({"prompt": "1+1="}, 400, "model"),
    ({"model": "treerl", "prompt": "1+1=", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "treerl", "prompt": "1+1=", "temperature": "hot"}, 400, "temperature"),
    ({"model": "treerl", "prompt": 7}, 400, "prompt"),
    ({"model": "treerl", "prompt": "1+1=", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "treerl", "prompt": "1+1=", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "treerl", "prompt": "1+1=", "max_tokens": CONTEXT}, 400, "max_tokens"),
    ({"model": "treerl", "prompt": "1" * CONTEXT, "max_tokens": 1}, 400, "prompt"),
    ({"model": "treerl", "prompt": "1+1=", "n": 0}, 400, "n"),
    ({"model": "treerl", "prompt": [1, 2, 100000]}, 400, "prompt"),
    ({"model": "treerl", "prompt": [1, -1]}, 400, "prompt"),
    ({"model": "treerl", "prompt": "1+1=", "top_p": 0}, 400, "top_p"),
    ({"model": "treerl", "prompt": "1+1=", "stream": "yes"}, 400, "stream"),
    ({"model": "treerl", "prompt": "1+1=", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ({"model": "treerl", "prompt": "\u00e9"}, 400, "prompt"),
]
BAD_CHAT = [
    ({"model": "treerl", "messages": []}, 400, "messages"),
    ({"model": "treerl", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "treerl", "messages": [{"role": "user"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "treerl", "messages": [{"role": "user", "content": "1" * CONTEXT}]}, 400, "messages"),
]


def test_bad_requests_get_4xx_naming_the_field_and_the_server_keeps_serving(served):
    server, _, _ = served
    http = http_module()
    with http.Client(base_url=server.url, timeout=30) as c:
        for path, cases in (("/completions", BAD), ("/chat/completions", BAD_CHAT)):
            for body, status, param in cases:
                if isinstance(body, bytes):
                    r = c.post(path, content=body, headers={"content-type": "application/json"})
                else:
                    r = c.post(path, json=body)
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["message"], (body, err)
        ok = c.post("/completions", json={"model": "treerl", "prompt": "1+1=", "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) >= 1
        assert c.get(server.url.replace("/v1", "/health")).json()["status"] == "ok"

    async def via_openai():  # the openai package raises its typed errors, with the field
        c = client(server)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="treerl", prompt="1+1=", max_tokens=0)
        assert e.value.body["param"] == "max_tokens"
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="nope", prompt="1+1=", max_tokens=1)

    asyncio.run(via_openai())


class BlockAfter:
    """A pre-hook on the served model's input embedding (every forward calls it, whichever
    decode path runs): after ``calls`` forwards, set ``reached`` and wait (in the engine's
    thread, inside the forward) until ``until()`` holds."""

    def __init__(self, model, calls: int, until):
        self.count, self.calls, self.until = 0, calls, until
        self.reached = threading.Event()
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.count += 1
        if self.count >= self.calls and not self.reached.is_set():
            self.reached.set()
            while not self.until():
                threading.Event().wait(0.002)

    def remove(self):
        self.handle.remove()


def test_weight_update_endpoint_interrupts_generation(served, tmp_path):
    server, engine, tok = served
    prompt = greedy_text_without_eos(engine, tok, 24)
    new = tiny_model(seed=1, **served_config(tok))
    ckpt = save_checkpoint(tmp_path / "checkpoints", 3, new, tok, {"step": 3})
    v0 = engine.version
    # block the engine after a few decode steps until the update is waiting for it
    hook = BlockAfter(engine.model, 4, until=lambda: engine._pending_updates > 0)

    async def main():
        c = client(server, timeout=120)
        http = http_module()
        task = asyncio.ensure_future(c.completions.create(model="treerl", prompt=prompt, max_tokens=24, temperature=0))
        await asyncio.to_thread(hook.reached.wait)
        async with http.AsyncClient(timeout=120) as h:
            r = await h.post(server.url.replace("/v1", "/update_weights_from_disk"),
                             json={"model_path": str(tmp_path), "version": v0 + 5})
        assert r.status_code == 200 and r.json()["weight_version"] == v0 + 5
        return await task

    try:
        out = asyncio.run(main())
    finally:
        hook.remove()
    versions = out.choices[0].model_extra["token_versions"]
    assert versions[0] == v0 and versions[-1] == v0 + 5 and versions == sorted(versions)
    assert engine.version == v0 + 5
    for (k, a), b in zip(engine.model.state_dict().items(), new.state_dict().values()):
        assert torch.equal(a, b), k
    assert ckpt.is_dir()
    # a missing path is a 400 naming model_path; the server keeps serving
    with http_module().Client(timeout=30) as h:
        r = h.post(server.url.replace("/v1", "/update_weights_from_disk"), json={"model_path": str(tmp_path / "no")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path"


def test_server_stopped_mid_request_client_errors_and_retries():
    tok = CharTokenizer()
    engine = RolloutEngine(tiny_model(**served_config(tok)))
    server = ServerThread(make_state(engine, tok)).start()
    stopped = threading.Event()
    hook = BlockAfter(engine.model, 2, until=stopped.is_set)
    attempts = []

    async def main():
        http = http_module()
        http_client = http.AsyncClient(event_hooks={"request": [lambda req: _note(attempts, req)]})
        c = openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=2, timeout=30, http_client=http_client)
        task = asyncio.ensure_future(c.completions.create(model="treerl", prompt="1+1=", max_tokens=20))
        await asyncio.to_thread(hook.reached.wait)
        await asyncio.to_thread(server.stop, force=True, stop_loop=False)
        stopped.set()
        t = time.monotonic()
        with pytest.raises(openai.APIConnectionError):
            await task
        return time.monotonic() - t

    try:
        waited = asyncio.run(main())
    finally:
        stopped.set()
        hook.remove()
        server.state.loop.stop()
    assert len(attempts) == 3  # the first try and 2 retries, all refused
    assert waited < 30


async def _note(attempts, request):
    attempts.append(request.url.path)


def test_64_concurrent_agents_lose_and_duplicate_nothing(served, tmp_path):
    """64 agents x 3 turns of chat on loopback: every request answered once, for its own
    prompt; latency percentiles recorded."""
    server, engine, tok = served
    before = server.state.loop.stats.completed
    counters = server.state.loop.engine_stats()
    latencies: list[float] = []
    seen: list[tuple[int, int]] = []

    async def agent(c, i):
        messages = [{"role": "user", "content": f"a{i}"}]
        for turn in range(3):
            t = time.perf_counter()
            r = await c.chat.completions.create(model="treerl", messages=messages, max_tokens=4)
            latencies.append(time.perf_counter() - t)
            sent = [tok.bos_token_id] + [x for role, text in [(m["role"], m["content"]) for m in messages]
                                         for x in _render(tok, role, text)] + [tok.assistant_token_id]
            assert r.model_extra["prompt_token_ids"] == sent  # the answer is to this agent's own prompt
            seen.append((i, turn))
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"t{turn}"}]

    async def main():
        c = client(server, timeout=120, max_retries=0)
        await asyncio.wait_for(asyncio.gather(*(agent(c, i) for i in range(64))), 240)

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    assert sorted(seen) == [(i, t) for i in range(64) for t in range(3)]
    assert server.state.loop.stats.completed - before == 64 * 3
    health = asyncio.run(_health(server))["engine"]  # the engine's counters, summed over streams
    assert health["admitted"] - counters.admitted == 64 * 3
    assert health["prefix_cache_hit_tokens"] > counters.prefix_cache_hit_tokens  # turns extend earlier prompts
    assert health["decode_steps"] > counters.decode_steps and health["admissions"] >= counters.admissions + 1
    p = np.percentile(latencies, [50, 90, 99])
    record = {"requests": len(latencies), "wall_s": wall, "p50_s": p[0], "p90_s": p[1], "p99_s": p[2]}
    gc.collect()  # a full pass, counted in /health's host figures
    host = asyncio.run(_health(server))["host"]
    assert host["gc"]["passes"][2] >= 1 and host["gc"]["seconds"][2] > 0
    if sys.platform.startswith("linux"):  # the engine thread ran the 192 requests
        assert host["engine_thread"]["cpu_s"] > 0 and host["engine_thread"]["cpu_wait_s"] >= 0
        assert host["other_threads_cpu_s"]["treerl-serve"] > 0  # the HTTP server's event loop served 192 calls
    (tmp_path / "latency.json").write_text(json.dumps(record))
    print("64 agents x 3 turns:", record)


LONG = 256  # the long request's tokens (greedy, a prompt whose greedy continuation has no eos)


class ShortsBesideLong:
    """The gate of :func:`test_short_requests_with_mixed_settings_finish_while_a_long_one_streams`:
    ``loop.submit`` wrapped (the long request's listener noted, the other requests' futures kept)
    and a pre-hook on the served model's input embedding (every forward, whichever path). It
    holds the engine thread, inside a forward, (1) from the first forward after the long
    request's first tokens reached its listener until all ``shorts`` requests are in the engine
    loop, and (2) at the first forward after every short future resolved, until ``received``
    (the client has every short response; at once when it has them already). Each wait ends after 60 s
    (``timed_out``: a failure, never a hang)."""

    def __init__(self, loop, engine, shorts: int):
        self.loop, self.shorts, self.real_submit = loop, shorts, loop.submit
        self.long_emitted, self.shorts_in, self.received = threading.Event(), threading.Event(), threading.Event()
        self.long_future, self.futures, self.timed_out = None, [], []
        self.long_running_when_shorts_done = False
        self.long_first_tokens = 0  # the long row's tokens in its first delta
        self.steps = {}  # the engine's decode steps at (1)'s release and at (2)
        loop.submit = self.submit
        self.handle = engine.model.get_input_embeddings().register_forward_pre_hook(self)

    def submit(self, prompt, params, *, listener=None):
        long = params.max_new_tokens == LONG
        if long and listener is not None:
            inner = listener

            def listener(delta):
                inner(delta)
                if delta.token_ids and not self.long_emitted.is_set():
                    self.long_first_tokens = len(delta.token_ids)
                    self.long_emitted.set()

        future = self.real_submit(prompt, params, listener=listener)
        if long:
            self.long_future = future
        elif self.long_emitted.is_set():
            self.futures.append(future)
            if len(self.futures) == self.shorts:
                self.shorts_in.set()
        return future

    def __call__(self, module, args):
        if self.long_emitted.is_set() and "released" not in self.steps:
            if not self.shorts_in.wait(60):
                self.timed_out.append("shorts_in")
            self.steps["released"] = self.loop.engine_stats().decode_steps
        elif self.shorts_in.is_set() and "shorts_done" not in self.steps and all(f.done() for f in self.futures):
            # the first forward after every short finished (the client may have its answers already: the
            # futures resolve between two forwards, and the answers go out from the event loop meanwhile)
            self.long_running_when_shorts_done = not self.long_future.done()
            self.steps["shorts_done"] = self.loop.engine_stats().decode_steps
            if not self.received.wait(60):
                self.timed_out.append("received")

    def release(self):
        self.shorts_in.set()
        self.received.set()
        self.handle.remove()
        self.loop.submit = self.real_submit


def test_short_requests_with_mixed_settings_finish_while_a_long_one_streams():
    """A real server on loopback, the ``openai`` client: a LONG streamed request (greedy, 256
    tokens: its prompt's greedy continuation holds no eos) and, once its first content chunk
    arrived, 7 short requests of mixed settings (max_tokens 5-12, stop token ids, a stop
    string, temperature 0 / 0.8 / 1 / 1.3, top_p, top_k, min_p, seeds, n=2) in the same
    running batch. Every short response arrives while the long stream has not sent its final
    chunk, and each honours its settings: greedy = greedy alone (and its length = max_tokens:
    no stop possible), the stop id and stop string cut where the greedy text has them, the two
    requests of one seed (temperature 1) give the same text, as alone, and so does a seeded
    top-k/min-p one.

    The order is guaranteed by step counts, not time (:class:`ShortsBesideLong`): the engine is
    held at its first forward after the long row's first tokens reached the host until the 7
    short requests are in the engine loop (so the client's latency cannot let the long run
    ahead); they are admitted before the next decode step and each is done after at most
    max_tokens (<= 12) decode steps, when the long row has more than 200 of its 256 to go (its
    first tokens reach the host within a few 8-step sync windows). And the long row's next
    forward after the last short finished is held until the client has all short responses,
    so what the client sees (shorts answered, no final chunk of the long) follows from that
    order, not from the speed of the HTTP path."""
    from treerl.rollout import SamplingParams

    tok = CharTokenizer()
    engine = RolloutEngine(tiny_model(**served_config(tok, context=LONG + 64)))
    long_prompt = greedy_text_without_eos(engine, tok, LONG)
    long_ref = engine.generate([long_prompt], SamplingParams(temperature=0, max_new_tokens=LONG))[0][0]
    long_ref = long_ref.completion_ids.tolist()
    plain = greedy_text_without_eos(engine, tok, 12, plain=True)  # greedy: no special token in 12
    server = ServerThread(make_state(engine, tok, ServeOptions(default_max_tokens=8))).start()
    gate = None

    def req(prompt, max_tokens, **kw):
        body = {k: kw.pop(k) for k in ("top_k", "min_p", "stop_token_ids") if k in kw}
        return dict(model="treerl", prompt=prompt, max_tokens=max_tokens, extra_body=body or None, **kw)

    seeded = req("7*8=", 10, temperature=1.0, top_p=0.9, seed=1234)
    top_k_min_p = req("3+4=", 7, temperature=0.8, top_k=8, min_p=0.05, seed=7)

    async def main():
        nonlocal gate
        c = client(server, timeout=120, max_retries=0)
        greedy = (await c.completions.create(**req(plain, 12, temperature=0))).choices[0]  # alone
        g = greedy.model_extra["token_ids"]
        assert len(g) == 12 and greedy.finish_reason == "length"
        alone = [(await c.completions.create(**r)).choices[0].model_extra["token_ids"] for r in (seeded, top_k_min_p)]
        stop = tok.decode(g[4:6])
        shorts = {
            "greedy": req(plain, 5, temperature=0),
            "stop_id": req(plain, 12, temperature=0, stop_token_ids=[g[3]]),
            "stop_str": req(plain, 12, temperature=0, stop=[stop]),
            "seed_a": seeded,
            "seed_b": seeded,
            "top_k_min_p": top_k_min_p,
            "hot": req("9-2=", 9, temperature=1.3, top_k=-1, n=2),
        }
        gate = ShortsBesideLong(server.state.loop, engine, len(shorts))
        first, final = asyncio.Event(), asyncio.Event()

        async def stream_long():
            s = await c.completions.create(model="treerl", prompt=long_prompt, max_tokens=LONG, temperature=0,
                                           stream=True)
            text, ids, finish = "", [], None
            async for chunk in s:
                for ch in chunk.choices:
                    text += ch.text
                    ids += ch.model_extra["token_ids"]
                    if ch.text:
                        first.set()
                    if ch.finish_reason is not None:
                        finish = ch.finish_reason
                        final.set()
            return text, ids, finish

        long_task = asyncio.ensure_future(stream_long())
        await asyncio.wait_for(first.wait(), 120)
        got = await asyncio.wait_for(asyncio.gather(*(c.completions.create(**r) for r in shorts.values())), 120)
        running = not final.is_set() and not long_task.done()  # the long stream has not ended
        gate.received.set()
        return g, alone, stop, shorts, dict(zip(shorts, got)), running, await asyncio.wait_for(long_task, 120)

    try:
        g, alone, stop, shorts, got, running, (long_text, long_ids, long_finish) = asyncio.run(main())
    finally:
        if gate is not None:
            gate.release()
        server.stop()
    assert not gate.timed_out
    assert running and gate.long_running_when_shorts_done  # every short answered while the long one runs
    # the step counts of the docstring: the shorts took far fewer decode steps than the long row had left
    assert gate.long_first_tokens + gate.steps["shorts_done"] - gate.steps["released"] < LONG // 2, gate.steps
    assert long_ids == long_ref and long_finish == "length"  # greedy alone, whatever ran beside it
    assert long_text == tok.decode(long_ref, skip_special_tokens=True)

    def ids(name):
        return got[name].choices[0].model_extra["token_ids"]

    assert ids("greedy") == g[:5] and got["greedy"].choices[0].finish_reason == "length"  # greedy = greedy alone
    assert ids("stop_id") == g[: g.index(g[3]) + 1] and got["stop_id"].choices[0].finish_reason == "stop"
    text = tok.decode(g)
    s = got["stop_str"].choices[0]
    assert s.text == text[: text.find(stop)] and s.finish_reason == "stop" and s.model_extra["stop_reason"] == stop
    assert ids("seed_a") == ids("seed_b") == alone[0]  # one seed, one text: in the same batch and alone
    assert ids("top_k_min_p") == alone[1]
    assert len(got["hot"].choices) == 2
    for name, r in got.items():  # max_tokens honoured: "length" exactly at it, else a stop (eos, id or string)
        for ch in r.choices:
            toks, limit = ch.model_extra["token_ids"], shorts[name]["max_tokens"]
            if ch.finish_reason == "length":
                assert len(toks) == limit, name
            else:
                assert ch.finish_reason == "stop" and len(toks) <= limit, name
                assert name in ("stop_id", "stop_str") or toks[-1] == tok.eos_token_id, name


def test_responses_are_not_held_back_by_nagle(served):
    """Every connection the server accepts has Nagle's algorithm off (TCP_NODELAY): with it on,
    a response body written after its headers waited for the client's delayed ACK on a
    kept-alive connection (+40 ms per request on Linux loopback)."""
    import socket

    server, _, _ = served

    async def main() -> list[int]:
        async with http_module().AsyncClient(timeout=60) as http:  # one kept-alive connection
            for _ in range(2):
                assert (await http.get(server.url.removesuffix("/v1") + "/health")).status_code == 200
            conns = list(server.server.server_state.connections)
            socks = [c.transport.get_extra_info("socket") for c in conns]
            return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks if s is not None]

    flags = asyncio.run(main())
    assert flags and all(flags)


async def _health(server: ServerThread) -> dict:
    async with http_module().AsyncClient(timeout=60) as http:  # httpx's default (5 s) is a deadline under load
        return (await http.get(server.url.removesuffix("/v1") + "/health")).json()


def test_engine_loop_sums_the_engine_counters_over_streams():
    """Each stream resets the engine's counters; EngineLoop.engine_stats() adds them up
    (drain ends the idle stream, the next request starts another)."""
    from treerl.rollout import SamplingParams
    from treerl.serve import EngineLoop

    engine = RolloutEngine(tiny_model(**served_config()))
    loop = EngineLoop(engine)
    key = SamplingParams(temperature=0.0, max_new_tokens=3)
    try:
        for i in range(3):
            [c] = loop.submit([5, 6, 7 + i], key).result(60)
            assert len(c) == 3
            assert loop.drain(60)
        total = loop.engine_stats()
        assert loop.stats.streams == 3 and total.admitted == 3 and total.generated_tokens == 9
        assert total.prefill_tokens == 9 and engine.stats.admitted == 1  # the last stream's own
    finally:
        loop.stop()


def _render(tok, role, text):
    marker = {"assistant": tok.assistant_token_id, "tool": tok.tool_token_id}.get(role, tok.user_token_id)
    return [marker, *tok.encode(text)] + ([tok.eos_token_id] if role == "assistant" else [])


def test_treerl_serve_command_serves_a_checkpoint_until_sigterm(serve_commands):
    # `treerl serve --weights <run dir> --port 0 --model-name ckpt` of a version-7 checkpoint of the
    # tiny served model, started with the first serve test (tests/serve/conftest.py)
    proc = serve_commands["test_treerl_serve_command_serves_a_checkpoint_until_sigterm"]
    try:
        line = ""
        while "listening on" not in line:
            line = proc.stderr.readline()
            assert line, "treerl serve exited before listening"
        url = line.split("listening on ")[1].split()[0]

        async def main():
            c = openai.AsyncOpenAI(base_url=url, api_key="x", timeout=60)
            return await c.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "1+1"}],
                                                   max_tokens=3)

        r = asyncio.run(main())
        assert r.model_extra["weight_version"] == 7 and r.choices[0].model_extra["token_ids"]
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=60) as health:
            frozen = json.loads(health.read())["host"]["gc"]["frozen"]
        assert frozen > 1000  # the model, tokenizer and engine out of the collector's full passes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_on_a_busy_or_invalid_port_is_one_line(capsys):
    """`treerl serve` checks the address before loading the model: exit 2 and one line."""
    import socket

    from treerl.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        assert main(["serve", "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"cannot listen on 127.0.0.1:{port} (Address already in use)" in err
        assert "choose another --port (0: any free port)" in err
    finally:
        busy.close()
    assert main(["serve", "--port", "70000"]) == 2
    assert "cannot listen on 127.0.0.1:70000 (a port is 0-65535)" in capsys.readouterr().err
    assert main(["serve", "--host", "256.1.1.1", "--port", "0"]) == 2
    assert "cannot listen on 256.1.1.1:0" in capsys.readouterr().err


@pytest.mark.parametrize("option,value,message", [
    ("--prefix-cache-tokens", "-1", "--prefix-cache-tokens: rollout.prefix_cache_tokens: -1 is not allowed"),
    ("--prefill-chunk-tokens", "0", "--prefill-chunk-tokens: rollout.prefill_chunk_tokens: 0 is not allowed"),
])
def test_serve_refuses_bad_rollout_options_before_loading_a_model(option, value, message, capsys, monkeypatch):
    """A bad ``--prefix-cache-tokens`` / ``--prefill-chunk-tokens``: one line, exit 2, and no
    model loaded first."""
    from treerl.cli import main
    from treerl.serve import server

    loaded = []
    monkeypatch.setattr(server, "load_for_serving", lambda *a, **k: loaded.append(a))
    assert main(["serve", "--port", "0", option, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and not loaded


def test_serving_from_model_path_does_not_build_the_task(tmp_path):
    """``model.path`` gives the tokenizer: the config's task (here a JSONL dataset that is not
    on this machine) is not built, as training needs it but serving does not."""
    from treerl.serve.server import load_for_serving

    tok = CharTokenizer()
    build_model("qwen3", "tiny", seed=0, vocab_size=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tokenizer, version = load_for_serving(
        None, [f"model.path={tmp_path}", "task.name=math_jsonl", f"task.kwargs={{path: {tmp_path / 'absent.jsonl'}}}"],
        None, "cpu", None)
    assert isinstance(tokenizer, CharTokenizer) and version == 0 and model.config.vocab_size == len(tok)


def test_serve_options_are_the_rollout_keys_and_the_engine_comes_from_the_one_builder():
    """``treerl serve``'s --prefix-cache-tokens / --prefill-chunk-tokens set the ``rollout``
    keys of the same names (checked as the keys are: one line naming the option and the key;
    without them, the config's keys; a server's default prefix cache when neither is set);
    the rest of the section comes from the config; the engine is ``build_rollout_engine``'s,
    with its arena not kept between streams."""
    from argparse import Namespace

    from treerl.config import ConfigError
    from treerl.rollout import build_rollout_engine
    from treerl.serve.server import serving_rollout_config

    overrides = ["rollout.max_batch_tokens=4096", "rollout.kv_block_size=32", "rollout.prefill_chunk_tokens=512"]
    r = serving_rollout_config(None, overrides, Namespace(prefix_cache_tokens=128, prefill_chunk_tokens=None))
    assert (r.max_batch_tokens, r.kv_block_size, r.prefill_chunk_tokens, r.prefix_cache_tokens) == (4096, 32, 512, 128)
    assert r.keep_stream_buffers is False
    r = serving_rollout_config(None, overrides, Namespace(prefix_cache_tokens=0, prefill_chunk_tokens=256,
                                                          kv_cache_dtype="fp8"))
    assert r.prefill_chunk_tokens == 256 and r.prefix_cache_tokens == 0 and r.kv_cache_dtype == "fp8"
    none = Namespace(prefix_cache_tokens=None, prefill_chunk_tokens=None)
    assert serving_rollout_config(None, ["rollout.prefix_cache_tokens=96"], none).prefix_cache_tokens == 96
    assert serving_rollout_config(None, [], none).prefix_cache_tokens == 1 << 17  # max_batch_tokens
    assert serving_rollout_config(None, ["rollout.max_batch_tokens=5000"], none).prefix_cache_tokens == 5000
    engine = build_rollout_engine(r, tiny_model(), version=3)
    assert (engine.version, engine.max_batch_tokens, engine.kv_block_size, engine.prefill_chunk_tokens) == (3, 4096, 32, 256)
    assert engine.keep_stream_buffers is False and engine.prefix_cache is None
    engine = build_rollout_engine(r, tiny_model(), prefix_cache_tokens=64)
    assert engine.prefix_cache.max_tokens == 64 and engine.version == 0
    with pytest.raises(ConfigError) as err:
        serving_rollout_config(None, [], Namespace(prefix_cache_tokens=16, prefill_chunk_tokens=0))
    assert str(err.value) == "--prefill-chunk-tokens: rollout.prefill_chunk_tokens: 0 is not allowed; allowed: >= 1"
