"""Chat requests -> prompt token ids, and completions -> assistant messages.

A tokenizer with a chat template (Hugging Face, ``tokenizer.chat_template``) renders the
whole conversation: ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)``
gets every message with all its fields (``tool_calls``, ``tool_call_id``, ``name``,
``reasoning_content``, ...) and the request's ``tools``. As vLLM does, a tool call's
``function.arguments`` (a JSON string from OpenAI clients) is handed to the template as a
dict (the Qwen templates write it with ``tojson``), and text content parts are joined with
newlines (templates expect a string; other part types are refused).

A tokenizer with role-marker tokens and no template
(:class:`~treerl.tasks.tokenizer.CharTokenizer`) uses treerl's marker layout, the one
:class:`~treerl.tasks.env.ChatFormat` gives multi-turn environments::

    <bos> <user> first message  <assistant> reply <eos>  <tool> result  <assistant> ...

(system and developer messages use the user marker, later user messages too; tool
messages the tool marker; an assistant message ends with eos, as a generated one does). An
assistant message's tool calls are written after its content by the server's tool-call
format (``--tool-call-parser``, e.g. ``tag``: ``<calc>37*48</calc>``). The layout has no
place for tool *definitions*: a model without a template knows its tools from training, and
``tools`` only tells the parser which calls to read.

Prompts are token-exact (:mod:`~treerl.serve.history`): an assistant turn this server
generated keeps the tokens the model produced wherever the template renders it unchanged.
Replies are parsed for tool calls (:mod:`~treerl.serve.tools`).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from .history import TokenHistory, conversation_keys, message_key
from .protocol import APIError
from .tools import ToolFormat, ToolStats, check_tool_choice, get_tool_format, tool_reply


def has_chat_format(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) or _markers(tokenizer) is not None


def _markers(tokenizer: Any) -> dict[str, int] | None:
    ids = {r: getattr(tokenizer, f"{r}_token_id", None) for r in ("user", "assistant", "tool")}
    return ids if all(i is not None for i in ids.values()) else None


# ----------------------------------------------------------------- messages
def _content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content.{k}: only text content parts are supported", f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise APIError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}.tool_calls.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"{here} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                           here)
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as err:
                raise APIError(f"{here}.function.arguments is not JSON ({err})", f"{here}.function.arguments") from None
        if not isinstance(args, dict):
            raise APIError(f"{here}.function.arguments must be a JSON object", f"{here}.function.arguments")
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def template_message(message: dict, where: str = "message") -> dict:
    """One OpenAI message as the chat template gets it (module docstring)."""
    out = {k: v for k, v in message.items() if v is not None}
    out["content"] = _content(message.get("content"), where)
    if message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], where)
    return out


def template_messages(messages: Sequence[Any]) -> list[dict]:
    """Request messages (pydantic :class:`~treerl.serve.protocol.ChatMessage` or dicts) as the
    chat template gets them."""
    out = []
    for i, m in enumerate(messages):
        d = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        out.append(template_message(d, f"messages.{i}"))
    return out


# ----------------------------------------------------------------- rendering
def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                tool_format: ToolFormat | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """The text of ``messages`` (template messages) followed by the generation prompt;
    ``template_kwargs``: more variables for the chat template (each one it reads, e.g. Qwen3's
    ``enable_thinking``; one it never names is refused, not ignored)."""
    if getattr(tokenizer, "chat_template", None):
        template = str(tokenizer.chat_template)
        if tools and "tools" not in template:
            raise APIError("this model's chat template does not render tools (it never reads `tools`): describe "
                           "the tools in a message instead", "tools")
        for key in template_kwargs or {}:
            if not re.search(rf"\b{re.escape(key)}\b", template):
                raise APIError(f"chat_template_kwargs.{key}: this model's chat template never reads {key!r}, so it "
                               "would change nothing: leave it out", f"chat_template_kwargs.{key}")
        try:
            return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=False, **(template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - jinja's errors (raise_exception, undefined fields)
            raise APIError(f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                           "messages") from None
    markers = _markers(tokenizer)
    if markers is None:
        raise APIError("this model's tokenizer has no chat template: use /v1/completions with a prompt", "messages")
    if template_kwargs:
        raise APIError("this model's tokenizer has no chat template to take chat_template_kwargs: leave them out",
                       "chat_template_kwargs")
    name = {r: tokenizer.decode([i]) for r, i in markers.items()}
    bos = getattr(tokenizer, "bos_token_id", None)
    out = [tokenizer.decode([bos])] if bos is not None else []
    for i, m in enumerate(messages):
        role = {"assistant": "assistant", "tool": "tool"}.get(m["role"], "user")
        body = m.get("content") or ""
        if m.get("tool_calls"):
            if tool_format is None:
                raise APIError(f"messages.{i}.tool_calls: this model has no chat template, so tool calls are written "
                               "by the server's tool-call format: start treerl serve with --tool-call-parser",
                               f"messages.{i}.tool_calls")
            body = tool_format.render(body, [c["function"] for c in m["tool_calls"]], tools or [])
        out += [name[role], body]
        if m["role"] == "assistant":
            out.append(tokenizer.decode([tokenizer.eos_token_id]))
    out.append(name["assistant"])
    return "".join(out)


def _decoder(tokenizer: Any):
    """``ids -> text`` with special tokens, no clean-up: the inverse of ``encode`` on the
    template's output (byte-level BPE, treerl's character tokenizer)."""
    params = inspect.signature(tokenizer.decode).parameters
    kw = {"skip_special_tokens": False}
    if "clean_up_tokenization_spaces" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kw["clean_up_tokenization_spaces"] = False
    return lambda ids: tokenizer.decode(ids, **kw)


@dataclass
class ChatTurn:
    """A chat request made ready to generate: prompt ``ids`` and what parsing and recording
    its replies need. ``forced``: token ids of a forced call opening (``tool_choice``
    required or a named function, ``tool_name``), generated from as if the model had written
    them: they are the first tokens of every completion."""

    ids: list[int]
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str  # auto, none, required or function
    key: bytes  # of the request's conversation
    forced: list[int] = field(default_factory=list)
    tool_name: str | None = None
    call_ends: tuple[str, ...] = ()  # stop strings ending the first call (parallel_tool_calls=false)


class ChatRenderer:
    """A server's chat front end: prompts (template, token-exact histories) and replies (tool
    calls). ``tool_call_parser``: a name of :func:`~treerl.serve.tools.tool_formats` or None
    (requests with tools then get a 400); ``history_tokens``: the token-exact record's size
    (0: off)."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None = None, history_tokens: int = 1 << 22):
        self.tokenizer = tokenizer
        self.tool_format = get_tool_format(tool_call_parser) if tool_call_parser else None
        self.history = TokenHistory(history_tokens)
        self.tool_stats = ToolStats()
        self._decode = _decoder(tokenizer)

    def stats(self) -> dict[str, dict]:
        """``{"tool_calls": ToolStats, "history": HistoryStats}`` as numbers."""
        return {"tool_calls": self.tool_stats.snapshot(), "history": self.history.stats.snapshot()}

    def _encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        except ValueError as err:  # a character the tokenizer cannot encode
            raise APIError(f"messages cannot be tokenized: {err}", "messages") from None

    def prompt(self, req: Any) -> ChatTurn:
        """The prompt of a :class:`~treerl.serve.protocol.ChatRequest` (:class:`APIError` on bad input)."""
        tools = req.tools
        choice, name = check_tool_choice(tools, req.tool_choice, self.tool_format)
        messages = template_messages(req.messages)
        text = render_chat(self.tokenizer, messages, tools, self.tool_format, req.chat_template_kwargs)
        keys = conversation_keys(messages)  # (hashes every message: once)
        ids = self.history.prompt_ids(messages, text, self._encode, self._decode, keys)
        forced = self._encode(self.tool_format.opening(name, tools)) if choice in ("required", "function") else []
        ends = ()
        if req.parallel_tool_calls is False and choice != "none" and tools:
            closings = self.tool_format.closings(tools)  # ([]: no call possible, so at most one)
            ends = tuple(closings or ())
            if closings is None:
                raise APIError(f"parallel_tool_calls=false: the {self.tool_format.name!r} tool-call format cannot "
                               "end a reply after one call; leave it unset", "parallel_tool_calls")
        return ChatTurn(ids, messages, tools, choice, keys[-1], forced, name, ends)

    def reply(self, turn: ChatTurn, text: str, finish_reason: str | None,
              completion_ids: Sequence[int], stop: Any = None) -> tuple[dict, str | None]:
        """The assistant message and finish reason of one choice (``text`` and
        ``completion_ids``: a forced opening included; ``stop``: what stopped it); records its
        tokens for the next turn. A reply stopped at the end of its first call
        (``turn.call_ends``) is parsed with that end (the stop string trimmed from ``text``)."""
        if stop in turn.call_ends and not text.endswith(stop):
            text += stop
        message, finish = tool_reply(text, finish_reason, turn.tools, turn.tool_choice, self.tool_format,
                                     self.tool_stats, turn.tool_name)
        self.history.record(message_key(turn.key, template_message(message)), turn.ids, completion_ids)
        return message, finish


__all__ = ["ChatRenderer", "ChatTurn", "render_chat", "template_message", "template_messages", "has_chat_format"]
