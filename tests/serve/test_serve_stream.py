"""Streaming (SSE) in treerl serve: the ``openai`` package's streams over loopback (greedy
streamed text equals the non-streamed, usage, token fields per chunk, stop strings), a
client that disconnects mid-stream (its rows are cancelled, the server keeps serving), and
:class:`~treerl.serve.detok.TextStream` on multi-byte characters and stop strings.

Synchronisation is by events, never by sleeping."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading

import openai
import pytest

from treerl.models import build_model
from treerl.rollout import RolloutEngine, SamplingParams
from treerl.serve import ServeOptions, ServerThread, make_state
from treerl.serve.client import http_module
from treerl.serve.detok import TextStream, completion_text
from treerl.tasks.tokenizer import CharTokenizer

CONTEXT = 96


@pytest.fixture(scope="module")
def served():
    tok = CharTokenizer()
    model = build_model("qwen3", "tiny", seed=0, max_position_embeddings=CONTEXT, **tok.hf_config_kwargs())
    engine = RolloutEngine(model)
    server = ServerThread(make_state(engine, tok, ServeOptions(default_max_tokens=8))).start()
    yield server, engine, tok
    server.stop()


def client(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key="x", timeout=60)


def plain_prompt(server, engine, tok, n_tokens: int) -> str:
    """A prompt whose greedy continuation has no special token in its first ``n_tokens``."""
    server.state.loop.drain()
    for i in range(200):
        prompt = f"q{i}?"
        ids = engine.generate([tok.encode(prompt, add_special_tokens=True)],
                              SamplingParams(temperature=0, max_new_tokens=n_tokens))[0][0].completion_ids.tolist()
        if min(ids) >= len(tok.special_tokens):
            return prompt
    raise AssertionError("no such prompt found")


def test_greedy_streamed_text_equals_the_non_streamed(served):
    server, engine, tok = served
    prompt = plain_prompt(server, engine, tok, 20)

    async def main():
        c = client(server)
        whole = await c.completions.create(model="treerl", prompt=prompt, max_tokens=20, temperature=0, n=2)
        chunks = [ch async for ch in await c.completions.create(
            model="treerl", prompt=prompt, max_tokens=20, temperature=0, n=2, stream=True,
            stream_options={"include_usage": True}, logprobs=1)]
        chat_whole = await c.chat.completions.create(model="treerl", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=20, temperature=0)
        chat_chunks = [ch async for ch in await c.chat.completions.create(
            model="treerl", messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0,
            stream=True, stream_options={"include_usage": True})]
        return whole, chunks, chat_whole, chat_chunks

    whole, chunks, chat_whole, chat_chunks = asyncio.run(main())
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    for j in range(2):
        mine = [x for ch in chunks[:-1] for x in ch.choices if x.index == j]
        ref = whole.choices[j]
        assert "".join(x.text for x in mine) == ref.text
        for name in ("token_ids", "token_logprobs", "token_versions"):
            assert [t for x in mine for t in x.model_extra[name]] == ref.model_extra[name], name
        assert [t for x in mine if x.logprobs for t in x.logprobs.token_logprobs] == ref.model_extra["token_logprobs"]
        assert [x.finish_reason for x in mine if x.finish_reason] == [ref.finish_reason]
        assert mine[-1].finish_reason is not None
    assert chat_chunks[0].object == "chat.completion.chunk" and chat_chunks[0].choices[0].delta.role == "assistant"
    body = [x for ch in chat_chunks[1:-1] for x in ch.choices]
    assert "".join(x.delta.content or "" for x in body) == chat_whole.choices[0].message.content
    assert [t for x in body for t in x.model_extra["token_ids"]] == chat_whole.choices[0].model_extra["token_ids"]
    assert chat_chunks[-1].usage.total_tokens == chat_whole.usage.total_tokens


def test_continuous_usage_stats_give_the_usage_so_far_in_every_chunk(served):
    """``stream_options.continuous_usage_stats`` (with ``include_usage``, vLLM's): every chunk's
    usage counts the tokens of the chunks so far (the prompt's every time); the last one's is the
    whole response's."""
    server, engine, tok = served
    prompt = plain_prompt(server, engine, tok, 12)

    async def main():
        c = client(server)
        kw = dict(model="treerl", prompt=prompt, max_tokens=12, temperature=0, n=2)
        whole = await c.completions.create(**kw)
        chunks = [ch async for ch in await c.completions.create(
            **kw, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})]
        return whole, chunks

    whole, chunks = asyncio.run(main())
    so_far = 0
    for ch in chunks:
        so_far += sum(len(x.model_extra["token_ids"]) for x in ch.choices)
        assert ch.usage.completion_tokens == so_far and ch.usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage and so_far == 24


def test_a_streamed_echo_equals_the_whole(served):
    """``echo`` with ``stream``: each choice's first chunk is its prompt (with ``logprobs``, the
    prompt's: none for its first token), then the generated chunks; all together the whole
    response's text and logprobs. ``max_tokens=0``: the prompt only, finish ``length``."""
    server, engine, tok = served
    prompt = plain_prompt(server, engine, tok, 6)

    async def main():
        c = client(server)
        out = []
        for kw in [dict(max_tokens=6, logprobs=2, n=2), dict(max_tokens=0, logprobs=1), dict(max_tokens=3),
                   dict(max_tokens=10, logprobs=1, n=2, prompt=[prompt, prompt])]:  # (several prompts)
            kw = dict(model="treerl", prompt=prompt, temperature=0, echo=True) | kw
            whole = await c.completions.create(**kw)
            out.append((whole, [ch async for ch in await c.completions.create(**kw, stream=True)]))
        return out

    for whole, chunks in asyncio.run(main()):
        for ref in whole.choices:
            mine = [x for ch in chunks for x in ch.choices if x.index == ref.index]
            assert mine[0].text == prompt and "".join(x.text for x in mine) == ref.text
            assert [x.finish_reason for x in mine if x.finish_reason] == [ref.finish_reason]
            if ref.logprobs is None:
                assert all(x.logprobs is None for x in mine)
                continue
            got = [t for x in mine if x.logprobs for t in x.logprobs.token_logprobs]
            assert got[0] is None and got[1:] == pytest.approx(ref.logprobs.token_logprobs[1:], abs=1e-6)
            assert [t for x in mine if x.logprobs for t in x.logprobs.tokens] == ref.logprobs.tokens
            # text_offset counts from the choice's start (the echoed prompt's), in every chunk, as whole
            assert [o for x in mine if x.logprobs for o in x.logprobs.text_offset] == ref.logprobs.text_offset
            tops = [d for x in mine if x.logprobs for d in x.logprobs.top_logprobs]
            assert tops[0] is None and len(tops) == len(ref.logprobs.top_logprobs)
            for d, want in zip(tops[1:], ref.logprobs.top_logprobs[1:]):
                assert d == pytest.approx(want, abs=1e-6)


def test_a_seeded_sampled_stream_equals_the_seeded_whole(served):
    server, _, _ = served

    async def main():
        c = client(server)
        kw = dict(model="treerl", prompt="7*8=", max_tokens=24, temperature=1.0, seed=11, n=2, logprobs=3)
        whole = await c.completions.create(**kw)
        chunks = [ch async for ch in await c.completions.create(stream=True, **kw)]
        return whole, chunks

    whole, chunks = asyncio.run(main())
    for j, ref in enumerate(whole.choices):
        mine = [x for ch in chunks for x in ch.choices if x.index == j]
        assert [t for x in mine for t in x.model_extra["token_ids"]] == ref.model_extra["token_ids"]
        assert "".join(x.text for x in mine) == ref.text
        assert [t for x in mine if x.logprobs for t in x.logprobs.top_logprobs] == ref.logprobs.top_logprobs


def test_streamed_text_stops_before_a_stop_string(served):
    server, engine, tok = served
    prompt = plain_prompt(server, engine, tok, 16)

    async def main():
        c = client(server)
        g = await c.completions.create(model="treerl", prompt=prompt, max_tokens=16, temperature=0)
        text = g.choices[0].text
        stop = text[5:8]
        whole = await c.completions.create(model="treerl", prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
        parts = [ch.choices[0].text async for ch in await c.completions.create(
            model="treerl", prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True)]
        return stop, whole, parts

    stop, whole, parts = asyncio.run(main())
    assert "".join(parts) == whole.choices[0].text and stop not in "".join(parts)


@contextlib.contextmanager
def held_at_first_tokens(loop, forward: bool):
    """Patch ``loop`` so that the engine thread blocks at a request's first token delivery
    until ``gate`` is set, and every ``loop.cancel`` is recorded (``cancelled`` set, its
    future in ``futures``). ``forward``: the request's own listener still gets the tokens
    (a streaming request); else the listener is replaced. Restored (and the gate opened) on
    leaving. Yields ``(cancelled, futures, delivered, gate)``."""
    cancelled, delivered, gate = threading.Event(), threading.Event(), threading.Event()
    futures = []
    original, submit = loop.cancel, loop.submit

    def spy(future):
        futures.append(future)
        cancelled.set()
        return original(future)

    def blocking_submit(prompt, params, *, listener=None):
        def first_tokens(delta):
            first = not delivered.is_set()
            delivered.set()
            if forward:
                listener(delta)
            if first:
                gate.wait(60)

        return submit(prompt, params, listener=first_tokens if listener is not None or not forward else None)

    loop.cancel, loop.submit = spy, blocking_submit
    try:
        yield cancelled, futures, delivered, gate
    finally:
        gate.set()
        loop.cancel, loop.submit = original, submit


def test_a_client_that_disconnects_mid_stream_frees_its_rows(served):
    server, engine, tok = served
    loop = server.state.loop
    http = http_module()
    prompt = plain_prompt(server, engine, tok, 24)  # greedy: no eos in its first 24 tokens, whatever ran before
    # the engine thread blocks in the stream's first token delivery until the server has cancelled
    with held_at_first_tokens(loop, forward=True) as (cancelled, futures, delivered, gate):
        with http.Client(base_url=server.url, timeout=60) as c:
            with c.stream("POST", "/completions", json={"model": "treerl", "prompt": prompt, "stream": True,
                                                        "max_tokens": CONTEXT - 8, "temperature": 0}) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())
                assert first.startswith("data: ") and json.loads(first[6:])["object"] == "text_completion"
            assert delivered.is_set()
            assert cancelled.wait(60)  # the server saw the disconnect and cancelled the rows
            gate.set()
            assert loop.drain(60) and loop.busy == 0
            [row] = futures[0].result(60)  # the row stopped where it was: far from its max_tokens
            assert row.finish_reason == "abort" and len(row) < CONTEXT - 8
            ok = c.post("/completions", json={"model": "treerl", "prompt": "1+1=", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]


def test_an_error_after_the_stream_began_ends_it_with_an_error_event(served, monkeypatch):
    """An exception in the server after a stream's first chunk (here: decoding its final text) is an
    error event in OpenAI's shape and ``data: [DONE]``, not a connection cut short; the server goes on."""
    import treerl.serve.streaming as streaming

    server, _, _ = served

    def broken(*args):
        raise RuntimeError("decoder gone")

    monkeypatch.setattr(streaming, "choice_text", broken)
    with http_module().Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/completions", json={"model": "treerl", "prompt": "1+", "stream": True,
                                                    "max_tokens": 3}) as r:
            assert r.status_code == 200
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        monkeypatch.undo()
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["type"] == "server_error" and "decoder gone" in error["message"]
        ok = c.post("/completions", json={"model": "treerl", "prompt": "1+1=", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"]


def test_a_non_streaming_client_that_disconnects_frees_its_rows(served):
    """A client of a non-streamed completion that goes away mid-generation (the ``openai``
    client's call cancelled: its connection closed) gets its rows cancelled as a streaming
    client does; the server keeps serving."""
    server, engine, tok = served
    loop = server.state.loop
    prompt = plain_prompt(server, engine, tok, 24)  # greedy: no eos in its first 24 tokens, whatever ran before

    # the engine thread blocks at the request's first tokens until the server has cancelled it
    with held_at_first_tokens(loop, forward=False) as (cancelled, futures, delivered, gate):
        async def main():
            async with client(server) as c:
                call = asyncio.ensure_future(c.completions.create(model="treerl", prompt=prompt,
                                                                  max_tokens=CONTEXT - 8, temperature=0))
                assert await asyncio.to_thread(delivered.wait, 60)  # generating: its first tokens reached the host
                call.cancel()  # the client goes away (its connection closed)
                with pytest.raises(asyncio.CancelledError):
                    await call
                assert await asyncio.to_thread(cancelled.wait, 60)  # the server saw the disconnect, cancelled the rows

        asyncio.run(main())
    assert loop.drain(60) and loop.busy == 0
    [row] = futures[0].result(60)  # the row stopped where it was: far from its max_tokens
    assert row.finish_reason == "abort" and len(row) < CONTEXT - 8
    ok = asyncio.run(client(server).completions.create(model="treerl", prompt="1+1=", max_tokens=2))
    assert ok.choices[0].model_extra["token_ids"]


def test_streamed_text_of_a_byte_level_bpe_equals_the_whole(served):
    """Random weights over a byte-level BPE: completions full of characters split over tokens."""
    from treerl.tasks.bpe import tiny_bpe_tokenizer

    tok = tiny_bpe_tokenizer()
    model = build_model("qwen3", "tiny", seed=1, vocab_size=len(tok), max_position_embeddings=CONTEXT,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    server = ServerThread(make_state(RolloutEngine(model), tok, ServeOptions(default_max_tokens=8))).start()

    async def main():
        c = client(server)
        kw = dict(model="treerl", messages=[{"role": "user", "content": "café ✓"}], max_tokens=40, temperature=0,
                  n=3, extra_body={"skip_special_tokens": False})
        whole = await c.chat.completions.create(**kw)
        chunks = [ch async for ch in await c.chat.completions.create(stream=True, **kw)]
        return whole, chunks

    try:
        whole, chunks = asyncio.run(main())
    finally:
        server.stop()
    for j, ref in enumerate(whole.choices):
        parts = [x.delta.content or "" for ch in chunks for x in ch.choices if x.index == j]
        assert "".join(parts) == ref.message.content  # (random bytes: the text may hold lone continuation bytes)
        ids = ref.model_extra["token_ids"]
        assert ref.message.content == tok.decode(ids, skip_special_tokens=False)


class ByteTokenizer:
    """Token ``i`` is byte ``i`` (a byte-level BPE's worst case: a character split over tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_emits_only_stable_text():
    tok = ByteTokenizer()
    text = "héllo ✓ wörld — fin"
    ids = list(text.encode())
    s = TextStream(tok)
    parts = [s.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) + s.finish(completion_text(tok, ids, None)) == text
    # a stop string: nothing at or after it is ever emitted, even split over tokens
    s = TextStream(tok, ["wör"])
    parts = [s.push([t]) for t in ids]
    assert "".join(parts) == "héllo ✓ "
    assert s.finish(completion_text(tok, ids, "wör")) == ""
    # include the stop string: no holding back
    s = TextStream(tok, ["wör"], include_stop_str=True)
    assert "".join(s.push([t]) for t in ids) == text


def test_incremental_decoding_gives_the_same_deltas_as_decoding_everything():
    """A byte-level BPE (concatenative: only the tokens after the last whole character are
    decoded at each push) streams exactly the deltas of decoding every token each time:
    random ids (bytes of multi-byte characters split over tokens, specials, added tokens),
    random batch sizes, stop strings, special tokens skipped or kept."""
    import random

    from helpers.chat import chat_tokenizer

    from treerl.serve.detok import concatenative
    from treerl.tasks.bpe import tiny_bpe_tokenizer

    assert not concatenative(CharTokenizer()) and not concatenative(ByteTokenizer())
    for tok in (tiny_bpe_tokenizer(), chat_tokenizer()):
        assert concatenative(tok)
        uni = tok.encode("héllo wörld — ☃ 日本語 🙂 <|im_end|> <tool_call> \ufffd", add_special_tokens=False)
        rng = random.Random(0)
        for trial in range(300):
            ids = [rng.choice(uni) if rng.random() < 0.6 else rng.randrange(len(tok)) for _ in range(rng.randrange(60))]
            kw = dict(stops=rng.choice([(), ("ö",), ("wör", "日本")]), skip_special_tokens=rng.random() < 0.5)
            fast, slow = TextStream(tok, **kw), TextStream(tok, **kw)
            slow._concat = False  # decodes everything at each push
            i = 0
            while i < len(ids):
                k = rng.randrange(1, 9)
                assert fast.push(ids[i: i + k]) == slow.push(ids[i: i + k])
                i += k
            final = completion_text(tok, ids, None, skip_special_tokens=kw["skip_special_tokens"])
            assert fast.finish(final) == slow.finish(final)
    with_clean_up = tiny_bpe_tokenizer()
    with_clean_up.clean_up_tokenization_spaces = True
    assert not concatenative(with_clean_up)
