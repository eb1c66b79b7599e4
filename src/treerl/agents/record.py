"""Recording an agent's calls: an HTTP transport under the ``openai`` client.

:class:`RecordingTransport` wraps the transport of the ``openai`` package's HTTP client.
For every ``.../completions`` request of an episode it fills in the trainer's sampling
defaults (fields the agent left unset), applies forced settings (greedy evaluation), sets
``model`` to the served policy, asks for token ids, and records the response's token ids,
behaviour logprobs and weight versions as a :class:`CallRecord`. The agent sees an ordinary
response. Nothing else (other endpoints, failed calls) is recorded.

Token data is read from treerl serve's fields (``prompt_token_ids``; per choice
``token_ids``, ``token_logprobs``, ``token_versions``). A server without
``token_logprobs`` (vLLM, SGLang: untested) is asked for ``logprobs`` and read from the
standard ``logprobs`` object; without ``token_versions`` every token gets the version the
trainer last pushed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..serve.client import http_module


@dataclass
class RecordedChoice:
    """One sampled completion: ``token_ids``, ``logprobs``, ``versions`` ``[T]``."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None = None


@dataclass
class CallRecord:
    """One model call of an episode. ``index``: order in which the episode sent it (0, 1, ...)."""

    index: int
    prompt_ids: list[int]
    choices: list[RecordedChoice]


@dataclass
class EpisodeLog:
    """The calls of one episode, in the order their responses arrived."""

    calls: list[CallRecord] = field(default_factory=list)
    sent: int = 0  # calls sent (recorded or not)


class RecordError(RuntimeError):
    """A response without the token data training needs."""


def parse_choices(body: dict, default_version: int) -> tuple[list[int], list[RecordedChoice]]:
    """Prompt token ids and the choices of a completions response (see the module docstring)."""
    prompt = body.get("prompt_token_ids")
    choices = body.get("choices") or []
    if prompt is None and choices and "prompt_token_ids" in choices[0]:
        prompt = choices[0]["prompt_token_ids"]  # vLLM's completions put it per choice
    if not isinstance(prompt, list):
        raise RecordError("the server's response has no prompt_token_ids: it must return token ids "
                          "(treerl serve does; vLLM with return_token_ids=true)")
    out = []
    for c in sorted(choices, key=lambda c: c.get("index", 0)):
        ids = c.get("token_ids")
        if not isinstance(ids, list):
            raise RecordError("a choice has no token_ids: the server must return completion token ids")
        lps = c.get("token_logprobs")
        if lps is None:
            lps = _standard_logprobs(c.get("logprobs"))
        if lps is None or len(lps) != len(ids):
            raise RecordError(f"a choice has {len(ids)} token ids but no matching per-token logprobs")
        versions = c.get("token_versions") or [default_version] * len(ids)
        out.append(RecordedChoice([int(t) for t in ids], [float(x) for x in lps], [int(v) for v in versions],
                                  c.get("finish_reason")))
    return [int(t) for t in prompt], out


def _standard_logprobs(lp: Any) -> list[float] | None:
    if not isinstance(lp, dict):
        return None
    if isinstance(lp.get("token_logprobs"), list):  # completions
        return lp["token_logprobs"]
    if isinstance(lp.get("content"), list):  # chat
        return [x["logprob"] for x in lp["content"]]
    return None


def recording_transport(inner: Any, log: EpisodeLog, *, model: str, defaults: dict, force: dict,
                        standard_logprobs: bool, default_version: int):
    """A transport of :func:`http_module` that records into ``log`` (module docstring).
    ``inner`` is shared by the episodes and is not closed with them."""
    http = http_module()

    class RecordingTransport(http.AsyncBaseTransport):
        async def handle_async_request(self, request):
            if request.method != "POST" or not request.url.path.endswith("/completions"):
                return await inner.handle_async_request(request)
            body = json.loads(await request.aread() or b"{}")
            chat = request.url.path.endswith("/chat/completions")
            for k, v in defaults.items():
                if body.get(k) is None and not (k == "max_tokens" and body.get("max_completion_tokens")):
                    body[k] = v
            body.update(force)
            body["model"] = model
            body["return_token_ids"] = True
            if standard_logprobs and not body.get("logprobs"):
                body["logprobs"] = True if chat else 1
            index = log.sent
            log.sent += 1
            headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
            request = http.Request(request.method, request.url, headers=headers,
                                   content=json.dumps(body).encode(), extensions=request.extensions)
            response = await inner.handle_async_request(request)
            content = await response.aread()
            if response.status_code == 200:
                prompt, choices = parse_choices(json.loads(content), default_version)
                log.calls.append(CallRecord(index, prompt, choices))
            headers = [(k, v) for k, v in response.headers.items()
                       if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")]
            return http.Response(response.status_code, headers=headers, content=content, request=request,
                                 extensions={k: v for k, v in response.extensions.items() if k != "network_stream"})

        async def aclose(self) -> None:  # the shared inner transport outlives the episode
            pass

    return RecordingTransport()
