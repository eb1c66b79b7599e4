"""Tool calling: the model's tool-call text <-> OpenAI ``tool_calls``.

A *tool-call format* knows how one model family writes calls; the server picks one by name
(``treerl serve --tool-call-parser NAME``, as vLLM and SGLang do). Formats:

- ``hermes``: the Qwen2.5 / Qwen3 (Hermes) format, one call per
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (both keys required;
  whitespace inside the tags allowed; the last call may lack its end tag); text before the
  first call is the content, text after the last is dropped (as vLLM's ``hermes`` does);
- ``llama3_json``: Llama 3.1 / 3.2's ``{"name": ..., "parameters": {...}}`` (a reply of calls only,
  ``;`` between them; any other reply is content);
- ``tag``: ``<NAME>VALUE</NAME>`` for a tool ``NAME`` whose parameters have exactly one
  property (the value, a string). Made for models without a chat template (treerl's
  character tokenizer, e.g. the calculator agent's ``<calc>37*48</calc>``).

Add one with :func:`register_tool_format` (a :class:`ToolFormat` subclass: ``parse`` and,
for tokenizers without a chat template, ``render``).

Malformed call text (a start tag whose call does not parse) is returned as plain content,
``finish_reason`` unchanged, and counted in :class:`ToolStats` (never an error).

Streamed (:class:`ContentStream`): the text before the first call's opening
(:meth:`ToolFormat.openings`) is content whatever the model writes after it, so it streams as it
comes, holding only a tail that may begin an opening; from the opening on the text is held, and
the parsed calls (or, when they do not parse, the held text as content) come in the choice's last
chunk: the streamed content and calls are those of the same reply answered whole.

``parallel_tool_calls=false``: at most one call, by stopping the generation at the end of the first
(the format's :meth:`ToolFormat.closings` as stop strings; the end is put back into the text that is
parsed, and the completion's tokens hold it, so the next turn extends them token for token).

``tool_choice`` (vLLM's semantics where treerl can honour them): ``auto`` (the default with
tools): calls are parsed; ``none``: the tools are still rendered into the prompt, calls are not
parsed (the text is the content); ``required`` and a named function *force the opening of a
call*: the generation continues from the format's opening (:meth:`ToolFormat.opening`;
``hermes``: ``<tool_call>``, with a name ``<tool_call>\n{"name": "NAME", ``) appended to
the prompt, and the reply is parsed with it. The name is forced; the arguments are the model's
own (no grammar constrains them): a reply whose call does not parse, or names a tool not in
``tools``, is returned as content and counted (``malformed``), never an error.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .protocol import APIError


@dataclass(frozen=True)
class ToolCall:
    """One call: ``arguments`` is the JSON text (an object)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    """A completion's text split into ``content`` (None when empty) and ``calls``."""

    content: str | None
    calls: list[ToolCall]


class MalformedToolCall(ValueError):
    """Call text that does not parse (the text is returned as content)."""


@dataclass
class ToolStats:
    """Counters of tool-call parsing (thread-safe; ``snapshot()`` for /metrics and /health)."""

    replies: int = 0  # replies parsed for tool calls (tool_choice auto, required or a named function)
    with_calls: int = 0  # replies that carried at least one call
    calls: int = 0  # calls returned
    malformed: int = 0  # replies whose call text did not parse, or (forced) named no tool of the request
    forced: int = 0  # replies generated from a forced call opening (tool_choice required or a named function)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"replies": self.replies, "with_calls": self.with_calls, "calls": self.calls,
                    "malformed": self.malformed, "forced": self.forced}


class ToolFormat:
    """How a model family writes tool calls. ``parse`` returns None when the text holds no
    call, raises :class:`MalformedToolCall` when call text does not parse."""

    name = ""

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedReply | None:
        raise NotImplementedError

    def render(self, content: str, calls: Sequence[dict], tools: Sequence[dict]) -> str:
        """An assistant message's text (``calls``: ``{"name", "arguments": dict}``), for
        tokenizers without a chat template."""
        raise NotImplementedError(f"the {self.name!r} tool-call format cannot render calls without a chat template")

    def opening(self, name: str | None, tools: Sequence[dict]) -> str:
        """The text that opens a call (``name``: of that tool, through its name; None: any
        tool), which a forcing ``tool_choice`` appends to the prompt. :class:`APIError` naming
        ``tool_choice`` when this format cannot force it."""
        raise APIError(f"the {self.name!r} tool-call format cannot force a call: send tool_choice='auto'",
                       "tool_choice")

    def closings(self, tools: Sequence[dict]) -> list[str] | None:
        """The strings that end a call: ``parallel_tool_calls=false`` stops the generation at the
        first (its stop strings). None: this format cannot end a reply after one call."""
        return None

    def openings(self, tools: Sequence[dict]) -> list[str] | None:
        """The strings one of which begins every call (:meth:`parse` finds no call in a text
        without one): the text before the first is content whatever follows, so it streams as it
        comes. None (a format that does not say): a streamed reply's text is held to its end."""
        return None

    def stream_end(self, held: str, tools: Sequence[dict], sent: int) -> tuple[int, bool] | None:
        """``(end, opened)`` of :func:`content_end` for the text of a streamed reply not sent yet
        (``held``; ``sent``: the characters before it, all content, so no opening begins there); None:
        hold all of it (by default, from :meth:`openings`)."""
        openings = self.openings(tools)
        return None if openings is None else content_end(held, openings)


_FORMATS: dict[str, Callable[[], ToolFormat]] = {}


def register_tool_format(name: str) -> Callable[[type], type]:
    """Class decorator: make a :class:`ToolFormat` available as ``--tool-call-parser NAME``."""

    def deco(cls: type) -> type:
        cls.name = name
        _FORMATS[name] = cls
        return cls

    return deco


def tool_formats() -> list[str]:
    return sorted(_FORMATS)


def get_tool_format(name: str) -> ToolFormat:
    try:
        return _FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(tool_formats())}") from None


def _arguments_json(args: Any, where: str) -> str:
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as err:
            raise MalformedToolCall(f"{where}: arguments are not JSON ({err})") from None
    if not isinstance(args, dict):
        raise MalformedToolCall(f"{where}: arguments must be a JSON object")
    return json.dumps(args, ensure_ascii=False)


@register_tool_format("hermes")
class HermesFormat(ToolFormat):
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.S)

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedReply | None:
        start = text.find(self.START)
        if start < 0:
            return None
        calls = []
        for m in self._CALL.finditer(text, start):
            body = m[1] if m[1] is not None else m[2]  # the last call may lack its end tag (vLLM's rule)
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as err:
                raise MalformedToolCall(f"tool call {len(calls)} is not JSON ({err})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
                raise MalformedToolCall(f"tool call {len(calls)} has no name or no arguments")
            calls.append(ToolCall(obj["name"], _arguments_json(obj["arguments"], f"tool call {len(calls)}")))
        return ParsedReply(text[:start] or None, calls)

    def render(self, content: str, calls: Sequence[dict], tools: Sequence[dict]) -> str:
        blocks = [f"{self.START}\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                  + f"\n{self.END}" for c in calls]
        return content + "\n".join(blocks)  # parse(render(c, calls)) gives c and calls back

    def openings(self, tools: Sequence[dict]) -> list[str]:
        return [self.START]

    def closings(self, tools: Sequence[dict]) -> list[str]:
        return [self.END]

    def opening(self, name: str | None, tools: Sequence[dict]) -> str:
        """``<tool_call>``, and with a name ``\n{"name": "NAME", `` after it (as the Qwen templates
        write a call: the model goes on with ``"arguments": ...``)."""
        if name is None:
            return self.START
        return f"{self.START}\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ", "


def _single_parameter(tool: dict) -> str | None:
    props = ((tool.get("function") or {}).get("parameters") or {}).get("properties") or {}
    return next(iter(props)) if len(props) == 1 else None


@register_tool_format("tag")
class TagFormat(ToolFormat):
    """``<NAME>VALUE</NAME>`` for tools with exactly one parameter."""

    def _tags(self, tools: Sequence[dict]) -> dict[str, str]:
        out = {}
        for t in tools:
            name, param = (t.get("function") or {}).get("name"), _single_parameter(t)
            if isinstance(name, str) and param is not None:
                out[name] = param
        return out

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedReply | None:
        tags = self._tags(tools)
        if not tags:
            return None
        names = "|".join(re.escape(n) for n in sorted(tags, key=len, reverse=True))
        first = re.search(f"<({names})>", text)
        if first is None:
            return None
        calls = []
        for m in re.finditer(f"<({names})>(.*?)(</\\1>|$)", text[first.start():], re.S):
            if not m[3]:
                raise MalformedToolCall(f"<{m[1]}> without </{m[1]}>")
            calls.append(ToolCall(m[1], json.dumps({tags[m[1]]: m[2]}, ensure_ascii=False)))
        return ParsedReply(text[: first.start()] or None, calls)

    def openings(self, tools: Sequence[dict]) -> list[str]:
        return [f"<{name}>" for name in self._tags(tools)]

    def closings(self, tools: Sequence[dict]) -> list[str]:
        return [f"</{name}>" for name in self._tags(tools)]

    def opening(self, name: str | None, tools: Sequence[dict]) -> str:
        """``<NAME>`` (required: the only tool this format can call, else refused)."""
        tags = self._tags(tools)
        if name is None:
            if len(tags) != 1:
                raise APIError(f"tool_choice='required' with the tag tool-call format needs exactly one tool with one "
                               f"parameter (the tag names the tool); these tools have {len(tags)}: send a named "
                               "function", "tool_choice")
            name = next(iter(tags))
        if name not in tags:
            raise APIError(f"the tag tool-call format calls tools with exactly one parameter; {name!r} is not one",
                           "tool_choice")
        return f"<{name}>"

    def render(self, content: str, calls: Sequence[dict], tools: Sequence[dict]) -> str:
        out = [content]
        for c in calls:
            args = c["arguments"]
            if len(args) != 1 or not isinstance(next(iter(args.values())), str):
                raise APIError(f"the tag tool-call format writes calls with one string argument; "
                               f"{c['name']!r} has {json.dumps(args)}", "messages")
            out.append(f"<{c['name']}>{next(iter(args.values()))}</{c['name']}>")
        return "".join(out)


@register_tool_format("llama3_json")
class Llama3JsonFormat(ToolFormat):
    """Llama 3.1 / 3.2's JSON calls (vLLM's ``llama3_json``): a reply that starts (after
    whitespace, and the ``<|python_tag|>`` token when special tokens are kept) with
    ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) is calls only, several separated
    by ``;``; any other reply is content. Text after the calls that is not a call: malformed."""

    TAG = "<|python_tag|>"

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedReply | None:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):]
        elif not body.startswith("{"):
            return None
        calls, decoder, i = [], json.JSONDecoder(), 0
        while True:
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
            if i == len(body):
                break
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError as err:
                raise MalformedToolCall(f"tool call {len(calls)} is not JSON ({err})") from None
            args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
            if args is None or not isinstance(obj.get("name"), str):
                raise MalformedToolCall(f"tool call {len(calls)} has no name or no parameters")
            calls.append(ToolCall(obj["name"], _arguments_json(args, f"tool call {len(calls)}")))
        if not calls:
            raise MalformedToolCall("<|python_tag|> without a call")
        return ParsedReply(None, calls)

    def stream_end(self, held: str, tools: Sequence[dict], sent: int) -> tuple[int, bool] | None:
        if sent > 0:  # (the reply began as content: all of it is)
            return len(held), False
        body = held.lstrip()
        if body.startswith(("{", self.TAG)):
            return 0, True
        if not body or self.TAG.startswith(body):
            return 0, False  # (whitespace, or the tag's start: a call may follow)
        return len(held), False

    def opening(self, name: str | None, tools: Sequence[dict]) -> str:
        """``{"name": "`` (any tool), ``{"name": "NAME", "parameters": `` (a named one)."""
        if name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '

    def render(self, content: str, calls: Sequence[dict], tools: Sequence[dict]) -> str:
        if content and calls:
            raise APIError("the llama3_json tool-call format writes a reply of calls only, without content", "messages")
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls) or content


# ----------------------------------------------------------------- tool_choice
def check_tool_choice(tools: list[dict] | None, tool_choice: Any, parser: ToolFormat | None) -> tuple[str, str | None]:
    """The effective choice of a request, ``(mode, name)``: mode ``"auto"``, ``"none"``,
    ``"required"`` or ``"function"`` (a named function: ``name``); :class:`APIError` for
    what is not served (see the module docstring)."""
    if tools is not None:
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str):
                raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               f"\"parameters\": ...}}}}", f"tools.{i}")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return "none", None
    if not tools:
        raise APIError("tool_choice is set but tools is not: send the tools the model may call", "tool_choice")
    if tool_choice not in ("auto", "required") and not isinstance(tool_choice, dict):
        raise APIError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got "
                       f"{json.dumps(tool_choice)}", "tool_choice")
    if parser is None:
        raise APIError("tool calling needs a tool-call parser: start treerl serve with --tool-call-parser "
                       f"({', '.join(tool_formats())}), or send tool_choice='none'", "tools")
    if tool_choice in ("auto", "required"):
        return tool_choice, None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise APIError('a named tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in tool_names(tools):
        raise APIError(f"tool_choice names {name!r}, which is not in tools ({', '.join(sorted(tool_names(tools)))})",
                       "tool_choice")
    return "function", name


def tool_names(tools: Sequence[dict]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def tool_reply(text: str, finish_reason: str | None, tools: list[dict] | None, choice: str,
               parser: ToolFormat | None, stats: ToolStats, name: str | None = None) -> tuple[dict, str | None]:
    """The assistant message (``content`` and, when the model called tools, ``tool_calls``)
    and the finish reason (``tool_calls`` when it did, whatever ended the completion: vLLM's
    rule) of a completion's text (with a forcing ``choice``: the forced opening included).
    Forced (``required``, or ``function`` with ``name``): a reply without a parsable call of
    the request's tools (the named one first) is content, counted as malformed."""
    if choice == "none" or parser is None or not tools:
        return {"role": "assistant", "content": text}, finish_reason
    forced = choice != "auto"
    try:
        parsed = parser.parse(text, tools)
        if forced and (parsed is None or not parsed.calls or any(c.name not in tool_names(tools) for c in parsed.calls)
                       or (name is not None and parsed.calls[0].name != name)):
            raise MalformedToolCall("a forced call that names no tool of the request")
    except MalformedToolCall:
        stats.add(replies=1, malformed=1, forced=int(forced))
        return {"role": "assistant", "content": text}, finish_reason
    if parsed is None or not parsed.calls:
        stats.add(replies=1)
        return {"role": "assistant", "content": text}, finish_reason
    stats.add(replies=1, with_calls=1, calls=len(parsed.calls), forced=int(forced))
    return ({"role": "assistant", "content": parsed.content, "tool_calls": [c.to_openai() for c in parsed.calls]},
            "tool_calls")


def content_end(text: str, openings: Sequence[str]) -> tuple[int, bool]:
    """``(end, opened)``: ``text[:end]`` is content whatever follows it (``opened``: a call's
    opening begins at ``end``; otherwise ``text[end:]`` is a proper prefix of an opening, or
    empty)."""
    hits = [i for o in openings if (i := text.find(o)) >= 0]
    if hits:
        return min(hits), True
    longest = max(map(len, openings), default=0)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        if any(o.startswith(text[i:]) for o in openings):
            return i, False
    return len(text), False


class ContentStream:
    """The content of one streamed chat choice (see the module docstring): ``push`` the text
    deltas (a :class:`~treerl.serve.detok.TextStream`'s) and get the part to send now;
    ``finish`` with the parsed reply's message gives the rest of its content. ``choice``:
    the request's effective ``tool_choice`` (forced ones hold everything: the text opens a call;
    ``none``: nothing is parsed, everything streams). Keeps only the text not sent yet, and none
    once a call opened (what follows comes from the parsed reply): linear in the reply's length."""

    def __init__(self, parser: ToolFormat | None, tools: Sequence[dict] | None, choice: str):
        self.parser, self.tools = parser, tools
        self.streams_all = choice == "none" or parser is None or not tools
        self.opened = not self.streams_all and choice != "auto"
        self.held, self.sent = "", []  # (the text not sent yet; the pieces sent)
        self.sent_chars = 0

    def push(self, delta: str) -> str:
        if self.opened:
            return ""
        self.held += delta
        if self.streams_all:
            found = len(self.held), False
        else:
            found = self.parser.stream_end(self.held, self.tools, self.sent_chars)
        if found is None:  # (a format that cannot tell: held to the end)
            self.opened = True
            return ""
        end, self.opened = found
        out, self.held = self.held[:end], self.held[end:]
        if out:
            self.sent.append(out)
            self.sent_chars += len(out)
        return out

    def finish(self, message: dict) -> str:
        """What the reply's content adds to the content sent (its calls come whole beside it)."""
        content, sent = message.get("content") or "", "".join(self.sent)
        assert content.startswith(sent), "the streamed content is not the reply's"
        return content[len(sent):]


__all__ = ["ToolCall", "ParsedReply", "MalformedToolCall", "ToolStats", "ToolFormat", "register_tool_format",
           "tool_formats", "get_tool_format", "HermesFormat", "Llama3JsonFormat", "TagFormat", "check_tool_choice",
           "tool_names", "tool_reply", "content_end", "ContentStream"]
