"""treerl serve's security, over real HTTP on loopback (uvicorn on an ephemeral port, the
`openai` client and its HTTP library, no mocks): the API key (401 in the OpenAI error
shape, /health open, the rollout backends send it), the exposure warning, reloads only under
the weights root (403) and only of intact weights of the served architecture (400 naming
the file or the config keys), and the cost caps: body size (413), prompt characters before
tokenizing (400), n and max_tokens (400 naming the cap), admission (429 + Retry-After). The
server keeps serving through every refusal.

Synchronisation is by events (the engine blocked inside a forward until released), never
by sleeping."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import openai
import pytest
import torch

from helpers.configs import AGENT_RUN, make_trainer, run_overrides
from helpers.models import tiny_model
from helpers.serve import CONTEXT, served_config
from treerl.models import build_model
from treerl.rollout import RolloutEngine
from treerl.serve import ServeOptions, ServerThread, make_state
from treerl.serve.client import http_module
from treerl.serve.limits import ServeLimits
from treerl.serve.security import exposure_warning
from treerl.tasks.tokenizer import CharTokenizer


KEY = "test-key-123"
LIMITS = ServeLimits(max_n=4, max_tokens=16, max_body_bytes=16 << 10, max_queued=2)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights_root")


@pytest.fixture(scope="module")
def served(root):
    tok = CharTokenizer()
    engine = RolloutEngine(tiny_model(**served_config(tok)))
    state = make_state(engine, tok, ServeOptions(default_max_tokens=4, limits=LIMITS, weights_root=str(root)))
    server = ServerThread(state, api_key=KEY).start()
    yield server, engine, tok
    server.stop()


def base(server) -> str:
    return server.url[: -len("/v1")]


def client(server, key=KEY, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60, **kw)


def works(server) -> None:
    """The server still serves: an authenticated completion."""
    out = asyncio.run(client(server).completions.create(model="treerl", prompt="1+1=", max_tokens=2))
    assert len(out.choices[0].model_extra["token_ids"]) >= 1


def post(server, path: str, key: str | None = KEY, headers: dict | None = None, **kw):
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    with http_module().Client(timeout=60) as h:
        return h.post(base(server) + path, headers=headers, **kw)


def assert_error(resp, status: int, param=None, code=None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


# ------------------------------------------------------------------ API key
def test_every_route_but_health_needs_the_key(served):
    server, engine, tok = served
    for key in (None, "wrong", KEY + "x", KEY[:-1]):
        err = assert_error(post(server, "/v1/completions", key=key, json={"model": "treerl", "prompt": "1"}),
                           401, code="invalid_api_key")
        assert "Authorization: Bearer" in err["message"]
        assert_error(post(server, "/update_weights_from_disk", key=key, json={"model_path": "/"}), 401)
    with http_module().Client(timeout=60) as h:
        assert h.get(base(server) + "/health").status_code == 200
        assert h.get(server.url + "/models").status_code == 401
        assert h.get(server.url + "/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(client(server, key="wrong").completions.create(model="treerl", prompt="1"))
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(client(server, key="wrong").chat.completions.create(
            model="treerl", messages=[{"role": "user", "content": "1"}]))
    works(server)


def test_non_loopback_without_key_warns_who_can_reach_it(capsys, monkeypatch):
    import treerl.serve.server as srv

    assert "any host that can reach this machine on port 8000 (all network interfaces)" in exposure_warning("0.0.0.0", 8000)
    assert "any host that can reach 10.1.2.3:8000" in exposure_warning("10.1.2.3", 8000)
    tok = CharTokenizer()
    state = make_state(RolloutEngine(tiny_model(**served_config(tok))), tok)
    monkeypatch.setattr(srv, "is_loopback", lambda host: False)  # stays on 127.0.0.1: nothing is exposed
    ServerThread(state).start().stop(stop_loop=False)
    err = capsys.readouterr().err
    assert "WARNING: listening on 127.0.0.1:" in err and "without an API key" in err and "TREERL_API_KEY" in err
    ServerThread(state, api_key=KEY).start().stop()
    assert "WARNING" not in capsys.readouterr().err


def test_serve_command_reads_the_key_from_the_environment(monkeypatch):
    from treerl.cli import parser
    from treerl.config import ConfigError
    from treerl.serve.server import security_options

    args = parser().parse_args(["serve"])
    monkeypatch.setenv("TREERL_API_KEY", "from-env")
    assert security_options(args)[0] == "from-env"
    assert security_options(parser().parse_args(["serve", "--api-key", "flag"]))[0] == "flag"
    monkeypatch.setenv("TREERL_API_KEY", " ")
    with pytest.raises(ConfigError, match="API key is empty"):
        security_options(args)
    with pytest.raises(ConfigError, match="--max-n must be >= 1"):
        security_options(parser().parse_args(["serve", "--api-key", "k", "--max-n", "0"]))
    monkeypatch.delenv("TREERL_API_KEY")
    assert security_options(args) == (None, ServeLimits(), None)  # no --weights: reloads refused


def test_serve_backend_uses_a_key_of_its_own(tmp_path):
    trainer = make_trainer(tmp_path, "rollout.backend=serve")
    try:
        server = trainer.sampler.agents.server
        assert trainer.sampler.agents.api_key and len(trainer.sampler.agents.api_key) >= 32
        assert_error(post(server, "/v1/completions", key="treerl", json={"model": "treerl", "prompt": "1"}), 401)
        samples = trainer.sampler.generate(trainer.sampler.next_problems(1), 2)  # the agents send the key
        assert len(samples) == 2
    finally:
        trainer.sampler.agents.close()


def test_remote_backend_sends_the_key_from_the_environment(tmp_path, monkeypatch):
    from treerl.serve.server import load_for_serving

    model, tok, _ = load_for_serving(None, run_overrides(None, *AGENT_RUN, "train.seed=5", task=None, layers=None), None,
                                     "cpu", None)
    engine = RolloutEngine(model)
    server = ServerThread(make_state(engine, tok, ServeOptions(weights_root=str(tmp_path))), api_key="remote-key")
    server.start()
    try:
        monkeypatch.delenv("TREERL_API_KEY", raising=False)
        trainer = make_trainer(tmp_path, "rollout.backend=remote", f"rollout.server_url={server.url}")
        try:
            with pytest.raises(RuntimeError, match="HTTP 401"):  # the weights push, without the key
                trainer.sampler.generate(trainer.sampler.next_problems(1), 2)
        finally:
            trainer.sampler.agents.close()
        monkeypatch.setenv("TREERL_API_KEY", "remote-key")
        trainer = make_trainer(tmp_path, "rollout.backend=remote", f"rollout.server_url={server.url}")
        try:
            samples = trainer.sampler.generate(trainer.sampler.next_problems(1), 2)
            assert len(samples) == 2 and engine.version == 0
        finally:
            trainer.sampler.agents.close()
    finally:
        server.stop()


# ------------------------------------------------------------------ weights
def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def reload(server, path, key=KEY):
    return post(server, "/update_weights_from_disk", key=key, json={"model_path": str(path)})


def test_reloads_only_under_the_weights_root(served, root, tmp_path):
    server, engine, tok = served
    outside = save_hf(tiny_model(seed=3, **served_config(tok)), tmp_path / "outside")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    v0 = engine.version
    err = assert_error(reload(server, outside), 403, param="model_path", code="outside_weights_root")
    assert str(root.resolve()) in err["message"]
    (root / "link").symlink_to(outside, target_is_directory=True)  # a symlink out of the root
    assert_error(reload(server, root / "link"), 403)
    assert_error(reload(server, f"{root}/../{outside.parent.name}/outside"), 403)  # '..' out of the root
    (root / "files").mkdir()
    (root / "files" / "model.safetensors").symlink_to(outside / "model.safetensors")  # a file linked out
    (root / "files" / "config.json").write_text((outside / "config.json").read_text())
    assert_error(reload(server, root / "files"), 403)
    assert engine.version == v0 and all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    inside = save_hf(tiny_model(seed=4, **served_config(tok)), root / "good")
    r = reload(server, inside)
    assert r.status_code == 200 and engine.version == v0 + 1
    works(server)


def test_reloads_without_a_root_are_refused():
    tok = CharTokenizer()
    with ServerThread(make_state(RolloutEngine(tiny_model(**served_config(tok))), tok)) as server:
        err = assert_error(reload(server, "/tmp", key=None), 403)
        assert "--weights-root" in err["message"]


def test_damaged_or_foreign_weights_get_400_naming_the_file_or_architecture(served, root):
    server, engine, tok = served
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    v0 = engine.version
    # a truncated file
    damaged = save_hf(tiny_model(seed=5, **served_config(tok)), root / "damaged")
    f = damaged / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = assert_error(reload(server, damaged), 400, param="model_path")
    assert str(f) in err["message"] and "damaged" in err["message"]
    # not safetensors at all
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x00" * 100)
    err = assert_error(reload(server, garbage), 400, param="model_path")
    assert str(garbage / "model.safetensors") in err["message"]
    # another architecture: its config says how
    wide = build_model("qwen3", "tiny", seed=0, max_position_embeddings=CONTEXT, hidden_size=96, **tok.hf_config_kwargs())
    other = save_hf(wide, root / "wide")
    err = assert_error(reload(server, other), 400, param="model_path")
    assert "another architecture" in err["message"] and "hidden_size 96" in err["message"]
    assert "served: " in err["message"] and "[" not in err["message"].split("hidden_size")[0]
    # the same config keys but other tensors (config.json removed): the shapes are named
    (other / "config.json").unlink()
    err = assert_error(reload(server, other), 400, param="model_path")
    assert "do not fit the served model" in err["message"] and "tensors of other shapes" in err["message"]
    assert engine.version == v0 and all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    works(server)


# ------------------------------------------------------------------ cost caps
def test_body_size_limit_413_with_and_without_content_length(served):
    server, engine, tok = served
    big = json.dumps({"model": "treerl", "prompt": "1" * (LIMITS.max_body_bytes + 10)}).encode()
    err = assert_error(post(server, "/v1/completions", content=big, headers={"content-type": "application/json"}),
                       413, code="request_too_large")
    assert str(LIMITS.max_body_bytes) in err["message"]

    def chunks():  # no Content-Length: chunked transfer
        for i in range(0, len(big), 4096):
            yield big[i: i + 4096]

    assert_error(post(server, "/v1/completions", content=chunks()), 413, code="request_too_large")
    with pytest.raises(openai.APIStatusError) as exc:
        asyncio.run(client(server).completions.create(model="treerl", prompt="1" * (LIMITS.max_body_bytes + 10)))
    assert exc.value.status_code == 413
    works(server)


def test_prompt_too_long_is_refused_before_tokenizing(served):
    server, engine, tok = served
    state = server.state
    assert state.limits.max_prompt_chars == 2 * CONTEXT * len("<|assistant|>")  # 2 x context x longest token
    calls = []

    class Spy:  # the tokenizer, counting encode calls
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, *a, **k):
            calls.append(1)
            return tok.encode(*a, **k)

    state.tokenizer = Spy()
    try:
        text = "1" * (state.limits.max_prompt_chars + 1)
        err = assert_error(post(server, "/v1/completions", json={"model": "treerl", "prompt": text}), 400,
                           param="prompt")
        assert "not tokenized" in err["message"]
        err = assert_error(post(server, "/v1/chat/completions", json={
            "model": "treerl", "messages": [{"role": "user", "content": text[:900]},
                                            {"role": "user", "content": text[:900]}]}), 400, param="messages")
        assert calls == []
        # within the bound but beyond the context: tokenized, then refused for length as before
        assert_error(post(server, "/v1/completions", json={"model": "treerl", "prompt": "1" * 200}), 400,
                     param="prompt")
        assert calls == [1]
    finally:
        state.tokenizer = tok
    works(server)


def test_caps_on_n_and_max_tokens_name_the_field_and_cap(served):
    server, engine, tok = served
    with pytest.raises(openai.BadRequestError) as exc:
        asyncio.run(client(server).completions.create(model="treerl", prompt="1", n=5, max_tokens=2))
    assert exc.value.body["param"] == "n" and "cap of 4" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        asyncio.run(client(server).chat.completions.create(model="treerl", messages=[{"role": "user", "content": "1"}],
                                                           max_tokens=17))
    assert exc.value.body["param"] == "max_tokens" and "cap of 16" in exc.value.body["message"]
    out = asyncio.run(client(server).completions.create(model="treerl", prompt="1", n=4, max_tokens=16))
    assert len(out.choices) == 4
    works(server)


class Gate:
    """Blocks the engine inside its next forward (a pre-hook on the input embedding) until
    :meth:`open`; ``reached`` is set once it blocks."""

    def __init__(self, model):
        self.reached, self.released = threading.Event(), threading.Event()
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.reached.set()
        self.released.wait(60)

    def open(self):
        self.released.set()
        self.handle.remove()


def test_queue_bound_429_with_retry_after(served):
    server, engine, tok = served
    gate = Gate(engine.model)
    inside = Entered(server.guard, 2)

    async def main():
        c = client(server)
        held = [asyncio.ensure_future(c.completions.create(model="treerl", prompt=p, max_tokens=2)) for p in "12"]
        await asyncio.to_thread(gate.reached.wait, 60)
        assert await asyncio.to_thread(inside.event.wait, 60)  # both admitted (one running, one waiting)
        http = http_module()
        async with http.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as h:
            r = await h.post(server.url + "/completions", json={"model": "treerl", "prompt": "3", "max_tokens": 2})
            # health and other routes are not generation: they are still answered
            health = await h.get(base(server) + "/health")
        gate.open()
        done = await asyncio.gather(*held)
        return r, health, done

    try:
        r, health, done = asyncio.run(main())
    finally:
        gate.open()
        inside.remove()
    err = assert_error(r, 429, code="server_busy")
    assert r.headers["retry-after"] == str(LIMITS.retry_after_s) and "--max-queued" in err["message"]
    assert health.status_code == 200 and all(len(d.choices) == 1 for d in done)
    assert server.guard.active == 0 and server.guard.stats.busy >= 1
    works(server)


class Entered:
    """Sets ``event`` once ``n`` generation requests have passed ``guard`` into the app."""

    def __init__(self, guard, n: int):
        self.guard, self.inner, self.n, self.event = guard, guard.app, n, threading.Event()
        guard.app = self

    async def __call__(self, scope, receive, send):
        if self.guard.active >= self.n:
            self.event.set()
        await self.inner(scope, receive, send)

    def remove(self):
        self.guard.app = self.inner


def test_tokenizing_does_not_block_other_clients(served):
    """A prompt is tokenized off the event loop: while one client's tokenization is held,
    another client's request is answered (the held one then completes)."""
    server, engine, tok = served
    state = server.state
    entered, release = threading.Event(), threading.Event()

    class Held:  # the tokenizer, holding its first encode until released
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, *a, **k):
            if not entered.is_set():
                entered.set()
                assert release.wait(60)
            return tok.encode(*a, **k)

    async def main():
        c = client(server)
        held = asyncio.ensure_future(c.completions.create(model="treerl", prompt="1+1=", max_tokens=2))
        assert await asyncio.to_thread(entered.wait, 60)
        other = await client(server).completions.create(model="treerl", prompt=[5, 6, 7], max_tokens=2)
        release.set()
        return other, await held

    state.tokenizer = Held()
    try:
        other, held = asyncio.run(main())
    finally:
        release.set()
        state.tokenizer = tok
    assert other.choices[0].model_extra["token_ids"] and held.choices[0].model_extra["token_ids"]
