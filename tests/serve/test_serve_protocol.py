"""treerl serve's protocol edges, driven over loopback with the ``openai`` package and its
HTTP library: refused fields, the OpenAI error shape on every path, echo and prompt
logprobs, top logprobs, several prompts per request, per-request seeds, /v1/models/{id},
/tokenize and /detokenize, /metrics, and tokenizing off the event loop.

Synchronisation is by events, never by sleeping."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from treerl.models import build_model
from treerl.rollout import RolloutEngine
from treerl.serve import ServeOptions, ServerThread, make_state
from treerl.serve.client import http_module
from treerl.tasks.tokenizer import CharTokenizer

CONTEXT = 64


class ControlledTokenizer:
    """A :class:`CharTokenizer` whose ``encode`` can be made to block until released (it sets
    ``entered`` first) and whose ``decode`` can be made to fail."""

    def __init__(self, tok: CharTokenizer):
        self._tok = tok
        self.block, self.fail = False, False
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, *a, **kw):
        if self.block:
            self.entered.set()
            self.release.wait(60)
        return self._tok.encode(*a, **kw)

    def decode(self, *a, **kw):
        if self.fail:
            raise RuntimeError("decode failed on purpose")
        return self._tok.decode(*a, **kw)


@pytest.fixture(scope="module")
def served():
    tok = ControlledTokenizer(CharTokenizer())
    model = build_model("qwen3", "tiny", seed=0, dtype=torch.float64, max_position_embeddings=CONTEXT,
                        **tok.hf_config_kwargs())
    engine = RolloutEngine(model)
    server = ServerThread(make_state(engine, tok, ServeOptions(default_max_tokens=8))).start()
    yield server, engine, tok
    server.stop()


def client(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key="x", timeout=60)


def root(server: ServerThread) -> str:
    return server.url.removesuffix("/v1")


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from a plain forward of the sequence alone."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


C = "/completions"
H = "/chat/completions"
P = {"model": "treerl", "prompt": "1+1="}
M = {"model": "treerl", "messages": [{"role": "user", "content": "1+1"}]}
REFUSED = [  # (path, body, the param named)
    (C, P | {"presence_penalty": 0.5}, "presence_penalty"),
    (C, P | {"frequency_penalty": -1.0}, "frequency_penalty"),
    (C, P | {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (C, P | {"suffix": "x"}, "suffix"),
    (C, P | {"best_of": 3}, "best_of"),
    (C, P | {"logprobs": 21}, "logprobs"),
    (C, P | {"max_tokens": 0}, "max_tokens"),  # without echo: nothing to return
    (C, P | {"min_p": 1.5}, "min_p"),
    (C, P | {"seed": -1}, "seed"),
    (C, P | {"stream_options": {"include_usage": True}}, "stream_options"),
    (C, P | {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (C, P | {"repetition_penalty": 1.1}, "repetition_penalty"),  # not a field at all
    (C, P | {"prompt": []}, "prompt"),
    (C, P | {"prompt": ["1+1=", "é"]}, "prompt.1"),
    (H, M | {"response_format": {"type": "json_object"}}, "response_format"),
    (H, M | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    (H, M | {"presence_penalty": 1.0}, "presence_penalty"),
    (H, M | {"logit_bias": {"3": -100}}, "logit_bias"),
    (H, M | {"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    (H, M | {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (H, M | {"store": True}, "store"),
    (H, M | {"service_tier": "flex"}, "service_tier"),
    (H, M | {"modalities": ["text", "audio"]}, "modalities"),
    (H, M | {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (H, M | {"functions": [{"name": "f"}]}, "functions"),
    (H, M | {"function_call": "auto"}, "function_call"),
    (H, M | {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (H, M | {"web_search_options": {}}, "web_search_options"),
    (H, M | {"reasoning_effort": "high"}, "reasoning_effort"),
    (H, M | {"verbosity": "low"}, "verbosity"),
    (H, M | {"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    (H, M | {"echo": True}, "echo"),
    (H, M | {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),  # no chat template here
    (H, M | {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),  # the server's own variable
]
ACCEPTED = [  # neutral values and fields that cannot change the output
    (C, P | {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u", "best_of": 1,
             "suffix": "", "return_token_ids": True, "min_p": 0.1, "seed": 3, "top_k": -1}),
    (H, M | {"response_format": {"type": "text"}, "user": "u", "metadata": {"a": "b"}, "store": False,
             "service_tier": "auto", "modalities": ["text"], "parallel_tool_calls": True, "tool_choice": "none",
             "prompt_cache_key": "k", "safety_identifier": "s", "max_completion_tokens": 2, "logprobs": False}),
]


def test_every_refused_field_is_a_400_naming_it(served):
    server, _, _ = served
    with http_module().Client(base_url=server.url, timeout=60) as c:
        for path, body, param in REFUSED:
            r = c.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param.split(".")[0] in err["message"], (body, err)
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        for path, body in ACCEPTED:
            r = c.post(path, json=body | {"max_tokens": 2} if path == C else body)
            assert r.status_code == 200, (body, r.text)


def test_openai_error_shape_on_every_path(served):
    server, _, tok = served
    with http_module().Client(base_url=root(server), timeout=60) as c:
        for method, path, body, status in (
            ("GET", "/v1/nothing", None, 404),
            ("POST", "/v2/completions", {}, 404),
            ("GET", "/v1/completions", None, 405),
            ("DELETE", "/v1/models", None, 405),
            ("POST", "/v1/completions", b"{not json", 400),
            ("POST", "/v1/completions", b"[1, 2]", 400),
            ("POST", "/tokenize", {"prompt": 5}, 400),
            ("GET", "/v1/models/gpt-4", None, 404),
        ):
            if isinstance(body, bytes):
                r = c.request(method, path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.request(method, path, json=body)
            assert r.status_code == status, (method, path, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (path, err)
        tok.fail = True  # an internal error: 500 in the same shape, and the server goes on
        try:
            r = c.post("/detokenize", json={"tokens": [5, 6]})
        finally:
            tok.fail = False
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "decode failed on purpose" in err["message"]
        assert c.post("/detokenize", json={"tokens": [5, 6]}).status_code == 200

    async def sdk():
        c = client(server)
        assert (await c.models.retrieve("treerl")).id == "treerl"
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("gpt-4")
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="treerl", messages=[{"role": "user", "content": "x"}],
                                            response_format={"type": "json_object"})
        assert e.value.body["param"] == "response_format"

    asyncio.run(sdk())


def test_tokenize_and_detokenize_round_trip(served):
    server, _, tok = served
    with http_module().Client(base_url=root(server), timeout=60) as c:
        r = c.post("/tokenize", json={"prompt": "12+7=", "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode("12+7=", add_special_tokens=True) and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == CONTEXT and len(r["token_strs"]) == r["count"]
        plain = c.post("/tokenize", json={"prompt": "12+7=", "add_special_tokens": False}).json()["tokens"]
        assert plain == tok.encode("12+7=", add_special_tokens=False)
        assert c.post("/detokenize", json={"tokens": plain}).json() == {"prompt": "12+7="}
        messages = [{"role": "user", "content": "hi"}]
        chat = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
        sent = c.post("/v1/chat/completions", json={"model": "treerl", "messages": messages, "max_tokens": 1})
        assert chat == sent.json()["prompt_token_ids"]
        info = c.get("/tokenizer_info").json()
        assert info["eos_token"] == tok.eos_token and info["model_max_length"] == CONTEXT
        assert c.post("/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"


def test_metrics_export_the_loop_and_engine_counters(served):
    server, _, _ = served
    server.state.metrics.counter("tool_call_parse_failures", "tool-call text the parser could not read").inc(2)
    with http_module().Client(base_url=root(server), timeout=60) as c:
        assert c.post("/v1/completions", json=P | {"max_tokens": 2}).status_code == 200
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    assert samples["treerl_loop_requests_total"].value >= 1
    assert samples["treerl_engine_decode_steps_total"].value >= 1
    assert samples["treerl_tool_call_parse_failures_total"].value == 2
    assert "treerl_weight_version" in samples and "treerl_busy_requests" in samples
    responses = [s for fam in text_string_to_metric_families(r.text) for s in fam.samples
                 if s.name == "treerl_http_responses_total"]
    assert any(s.labels == {"route": "/v1/completions", "status": "200"} for s in responses)


def test_health_answers_while_a_prompt_is_tokenized(served):
    server, _, tok = served
    http = http_module()
    result = {}

    def slow_request():
        with http.Client(base_url=server.url, timeout=60) as c:
            result["r"] = c.post("/completions", json=P | {"max_tokens": 1})

    tok.entered.clear()
    tok.release.clear()
    tok.block = True
    t = threading.Thread(target=slow_request)
    t.start()
    try:
        assert tok.entered.wait(60)  # the request is inside encode, in a worker thread
        with http.Client(base_url=root(server), timeout=60) as c:
            assert c.get("/health").json()["status"] == "ok"
            assert c.post("/detokenize", json={"tokens": [5]}).status_code == 200
    finally:
        tok.block = False
        tok.release.set()
        t.join(60)
    assert result["r"].status_code == 200


def test_echo_scores_the_prompt_as_the_model_does(served):
    server, engine, tok = served
    prompts = ["12+7=", "3*4=1"]
    ids = [tok.encode(p, add_special_tokens=True) for p in prompts]

    async def main():
        c = client(server)
        # lm-evaluation-harness's loglikelihood request: token-id prompts, echo, max_tokens 1, logprobs 1
        scored = await c.completions.create(model="treerl", prompt=ids, echo=True, max_tokens=1, logprobs=1,
                                            temperature=0, seed=1234)
        pure = await c.completions.create(model="treerl", prompt=prompts[0], echo=True, max_tokens=0, logprobs=3)
        plain = await c.completions.create(model="treerl", prompt=prompts[0], echo=True, max_tokens=2,
                                           temperature=0)
        return scored, pure, plain

    scored, pure, plain = asyncio.run(main())
    assert [ch.index for ch in scored.choices] == [0, 1]
    assert scored.model_extra["prompt_token_ids"] == ids
    engine_model = engine.model
    server.state.loop.drain()
    for ch, p in zip(scored.choices, ids):
        lp = ch.logprobs.token_logprobs
        assert len(lp) == len(p) + 1 and lp[0] is None and ch.logprobs.top_logprobs[0] is None
        ref = reference_logprobs(engine_model, p + ch.model_extra["token_ids"])
        assert torch.allclose(torch.tensor(lp[1:], dtype=torch.float64), ref, rtol=1e-9, atol=0)
        for tok_lp, top in zip(lp[1:], ch.logprobs.top_logprobs[1:]):
            assert max(top.values()) >= tok_lp  # the greedy check lm-eval does
        # the generated token is greedy: its logprob is the top one
        assert lp[-1] == pytest.approx(max(ch.logprobs.top_logprobs[-1].values()), rel=1e-12)
    c0 = pure.choices[0]
    assert c0.text == prompts[0] and c0.model_extra["token_ids"] == [] and pure.usage.completion_tokens == 0
    assert len(c0.logprobs.tokens) == len(ids[0]) and all(len(t) >= 3 for t in c0.logprobs.top_logprobs[1:])
    assert c0.logprobs.token_logprobs[1:] == scored.choices[0].logprobs.token_logprobs[1:-1]
    assert plain.choices[0].text.startswith(prompts[0]) and plain.choices[0].logprobs is None


def test_several_prompts_and_top_logprobs(served):
    server, engine, tok = served

    async def main():
        c = client(server)
        many = await c.completions.create(model="treerl", prompt=["1+1=", "2+2="], n=2, max_tokens=3,
                                          temperature=0, logprobs=2)
        one = [await c.completions.create(model="treerl", prompt=p, max_tokens=3, temperature=0)
               for p in ("1+1=", "2+2=")]
        chat = await c.chat.completions.create(model="treerl", messages=[{"role": "user", "content": "1+1"}],
                                               max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
        return many, one, chat

    many, one, chat = asyncio.run(main())
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]
    for i, single in enumerate(one):
        for j in range(2):
            ch = many.choices[i * 2 + j]
            assert ch.model_extra["token_ids"] == single.choices[0].model_extra["token_ids"]
            assert ch.text == single.choices[0].text
            assert len(ch.logprobs.top_logprobs) == len(ch.model_extra["token_ids"])
            for lp, top in zip(ch.logprobs.token_logprobs, ch.logprobs.top_logprobs):
                assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp, rel=1e-12)  # greedy
    assert many.usage.prompt_tokens == sum(len(p) for p in many.model_extra["prompt_token_ids"])
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_seed_gives_the_same_sample(served):
    server, _, _ = served

    async def main():
        c = client(server)
        kw = dict(model="treerl", prompt="1+1=", max_tokens=12, temperature=1.0)
        a, b = await asyncio.gather(c.completions.create(seed=7, **kw), c.completions.create(seed=7, **kw))
        d = await c.completions.create(seed=7, **kw, extra_body={"min_p": 0.05, "top_k": 20})
        return a, b, d

    a, b, d = asyncio.run(main())
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert d.choices[0].model_extra["token_ids"]
