"""Tool calling in treerl serve: the tool-call formats on text, tool_choice, the chat
template getting whole messages, and, end to end with the `openai` package on a loopback
server, tools in -> tool_calls out, a history holding a tool call whose prompt token ids
hold the call, and turn 2's prompt extending turn 1's prompt + completion token for token.

The served model is the tiny Qwen3 of ``helpers.chat`` whose weights make greedy decoding emit
one fixed tool call (a last-token lookup built into its weights: deterministic, no stub in
the server)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from helpers.chat import CALL, CALL_HEAD, CALL_TAIL, CALL_WHOLE, TOOLS, chat_tokenizer, tool_call_model

from treerl.rollout import RolloutEngine
from treerl.serve import ServeOptions, ServerThread, make_state
from treerl.serve.chat import ChatRenderer, render_chat, template_messages
from treerl.serve.protocol import APIError, ChatRequest
from treerl.serve.tools import (ContentStream, MalformedToolCall, ToolFormat, ToolStats, check_tool_choice,
                                content_end, get_tool_format, tool_formats, tool_reply)
from treerl.tasks.tokenizer import CharTokenizer

CALC = [{"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


# ------------------------------------------------------------------ formats on text
def test_hermes_parses_calls_content_and_the_unclosed_last_call():
    h = get_tool_format("hermes")
    r = h.parse('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "y": "é"}}\n</tool_call>\n'
                '<tool_call>{"name": "g", "arguments": "{\\"z\\": [1]}"}</tool_call> trailing', [])
    assert r.content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in r.calls] == [("f", {"x": 1, "y": "é"}), ("g", {"z": [1]})]
    assert r.calls[0].arguments == '{"x": 1, "y": "é"}'  # JSON text, not ASCII-escaped
    assert all(c.id.startswith("call_") for c in r.calls) and r.calls[0].id != r.calls[1].id
    assert h.parse("<tool_call>" + CALL_JSON_ + "\n", []).calls[0].name == "get_weather"  # stopped before the end tag
    assert h.parse("<tool_call>" + CALL_JSON_ + "</tool_call>", []).content is None
    assert h.parse("no call here", []) is None
    for bad in ["<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arg',
                '<tool_call>{"name": "f"}</tool_call>',
                '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>[]</tool_call>']:
        with pytest.raises(MalformedToolCall):
            h.parse(bad, [])
    assert h.render("", [CALL], []) == "<tool_call>\n" + CALL_JSON_ + "\n</tool_call>"
    again = h.parse(h.render("Sure. ", [CALL, CALL], []), [])
    assert again.content == "Sure. " and [json.loads(c.arguments) for c in again.calls] == [CALL["arguments"]] * 2


CALL_JSON_ = json.dumps(CALL)


def test_tag_format_reads_single_parameter_tools_and_renders_them_back():
    t = get_tool_format("tag")
    r = t.parse("<calc>37*48</calc><calc>1+1</calc>", CALC)
    assert r.content is None and [(c.name, json.loads(c.arguments)) for c in r.calls] == [
        ("calc", {"expression": "37*48"}), ("calc", {"expression": "1+1"})]
    assert t.parse("<answer>3</answer>", CALC) is None and t.parse("<calc>1</calc>", TOOLS) is None
    with pytest.raises(MalformedToolCall):
        t.parse("<calc>37*", CALC)
    assert t.render("", [{"name": "calc", "arguments": {"expression": "37*48"}}], CALC) == "<calc>37*48</calc>"
    assert set(tool_formats()) >= {"hermes", "tag"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; choose one of"):
        get_tool_format("nope")


def test_llama3_json_parses_calls_only_replies_and_streams_other_text_as_content():
    """vLLM's ``llama3_json``: a reply starting (after whitespace, or the ``<|python_tag|>`` token) with
    a JSON call is calls only, ``;`` between them, ``parameters`` or ``arguments``; other replies are
    content; a reply that starts as a call and does not parse is malformed (content, counted)."""
    f = get_tool_format("llama3_json")
    r = f.parse(' {"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": "{\\"y\\": [2]}"}', [])
    assert r.content is None and [(c.name, json.loads(c.arguments)) for c in r.calls] == [("f", {"x": 1}),
                                                                                         ("g", {"y": [2]})]
    assert f.parse('<|python_tag|>{"name": "f", "parameters": {}}', []).calls[0].arguments == "{}"
    assert f.parse("It is sunny. {not a call}", []) is None
    for bad in ['{"name": "f"}', '{"answer": 3}', '{"name": "f", "parameters": {}} and more', "<|python_tag|>",
                '{"name": "f", "parameters": [1]}']:
        with pytest.raises(MalformedToolCall):
            f.parse(bad, [])
    assert f.opening("get_weather", TOOLS) == '{"name": "get_weather", "parameters": '
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert f.parse(f.opening("get_weather", TOOLS) + '{"city": "Paris"}}', TOOLS).calls[0].name == "get_weather"
    assert f.render("", [CALL], TOOLS) == call and f.closings(TOOLS) is None
    for text, pieces in [(call, ["", call[:1], call[1:]]), ("  " + call, [" ", " ", call]),
                         ("<|python_tag|>" + call, ["<|py", "thon_tag|>", call]),
                         ("Sure, it is sunny.", ["Sure,", " it is", " sunny."]), ("<|py", ["<|py"])]:
        message, _ = tool_reply(text, "stop", TOOLS, "auto", f, ToolStats())
        assert "".join(pieces) == text
        out = _streamed(ContentStream(f, TOOLS, "auto"), pieces, message)
        assert "".join(out) == (message["content"] or "")
        if message.get("tool_calls"):
            assert not "".join(out[:-1])  # nothing of a call streams as content
    content = ContentStream(f, TOOLS, "auto")
    assert content.push("Sure") == "Sure" and content.push(', {"x": 1}') == ', {"x": 1}'  # content: all of it


def test_malformed_call_text_is_content_and_counted():
    stats = ToolStats()
    h = get_tool_format("hermes")
    text = '<tool_call>{"name": "f", "arg'
    assert tool_reply(text, "length", TOOLS, "auto", h, stats) == ({"role": "assistant", "content": text}, "length")
    message, finish = tool_reply("<tool_call>" + CALL_JSON_ + "</tool_call>", "stop", TOOLS, "auto", h, stats)
    assert finish == "tool_calls" and message["content"] is None and len(message["tool_calls"]) == 1
    # tool_choice none: the text is the content, nothing parsed, nothing counted
    assert tool_reply("<tool_call>" + CALL_JSON_, "stop", TOOLS, "none", h, stats)[0]["content"].startswith("<tool")
    assert stats.snapshot() == {"replies": 2, "with_calls": 1, "calls": 1, "malformed": 1, "forced": 0}
    # forced (required / a named function): a call of a tool not in the request, or not the named one, is content
    other = '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
    assert tool_reply(other, "stop", TOOLS, "required", h, stats)[0] == {"role": "assistant", "content": other}
    whole = "<tool_call>" + CALL_JSON_ + "</tool_call>"
    assert tool_reply(whole, "stop", TOOLS + CALC, "function", h, stats, "calc")[0]["content"] == whole
    message, finish = tool_reply(whole, "stop", TOOLS, "function", h, stats, "get_weather")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert stats.snapshot() == {"replies": 5, "with_calls": 2, "calls": 2, "malformed": 3, "forced": 3}


def _streamed(stream: ContentStream, pieces: list[str], message: dict) -> list[str]:
    """The content chunks of ``pieces`` pushed in turn, then what ``finish`` adds (the last)."""
    return [stream.push(p) for p in pieces] + [stream.finish(message)]


@pytest.mark.parametrize("text", [
    "Let me look it up.\n<tool_call>" + json.dumps(CALL) + "</tool_call>",  # content, then a call
    "<tool_call>" + json.dumps(CALL) + "</tool_call>",  # a call only
    "A < B and <tool_ is not a call <tool",  # opening-like tails, no call
    "Sure <tool_call>{not json}</tool_call> after",  # malformed: all of it content
    "no call at all",
])
def test_streamed_content_is_the_whole_replys_for_every_split_and_never_holds_call_markup(text):
    """Every split of the text into two or three deltas: the content chunks add up to the reply's
    content, nothing from a call's opening on streams before the end, and the text before the
    opening streams as soon as no opening can begin in it."""
    h = get_tool_format("hermes")
    message, _ = tool_reply(text, "stop", TOOLS, "auto", h, ToolStats())
    start = text.find("<tool_call>")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            out = _streamed(ContentStream(h, TOOLS, "auto"), [text[:i], text[i:j], text[j:]], message)
            assert "".join(out) == (message["content"] or "")
            early = "".join(out[:-1])
            assert "<tool_call>" not in early and (start < 0 or len(early) <= start)
            sent_by_j = "".join(out[:2])
            if start < 0 or j <= start:  # only a tail that may begin an opening waits
                held = text[len(sent_by_j):j]
                assert held == "" or ("<tool_call>".startswith(held) and len(held) < len("<tool_call>"))


def test_content_stream_choices_and_formats():
    h, t = get_tool_format("hermes"), get_tool_format("tag")
    assert content_end("abc <tool", ["<tool_call>"]) == (4, False)
    assert content_end("abc <tool_call> x", ["<tool_call>"]) == (4, True)
    assert content_end("x <calc>1", ["<calc>", "<c2>"]) == (2, True)
    assert content_end("x <c", ["<calc>", "<c2>"]) == (2, False)
    none = ContentStream(h, TOOLS, "none")  # nothing parsed: everything streams
    assert none.push("<tool_call>") == "<tool_call>" and none.finish({"content": "<tool_call>"}) == ""
    forced = ContentStream(h, TOOLS, "required")  # the text opens a call: held, its content comes at the end
    assert forced.push("\n{") == "" and forced.finish({"content": None}) == ""
    assert ContentStream(h, TOOLS, "function").finish({"content": "<tool_call>\n{bad"}) == "<tool_call>\n{bad"
    tag = ContentStream(t, CALC, "auto")  # the tag format's openings are its tools' tags
    assert [tag.push(p) for p in ["2 + <ca", "lc>1+1</calc>"]] == ["2 + ", ""]
    two = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}, "b": {}}}}}]
    assert ContentStream(t, two, "auto").push("<f>x") == "<f>x"  # no single-parameter tool: no call to hold

    class Custom(ToolFormat):  # a format that names no openings: its replies' text is held to the end
        def parse(self, text, tools):
            return None

    custom = ContentStream(Custom(), TOOLS, "auto")
    assert custom.push("hello") == "" and custom.finish({"content": "hello"}) == "hello"


def test_forced_call_openings():
    h, t = get_tool_format("hermes"), get_tool_format("tag")
    assert h.opening(None, TOOLS) == "<tool_call>"
    assert h.opening("get_weather", TOOLS) == '<tool_call>\n{"name": "get_weather", '
    assert (h.opening("get_weather", TOOLS) + '"arguments": {"city": "Paris"}}\n</tool_call>') == \
        h.render("", [CALL], TOOLS)  # the opening is how the format writes a call
    assert t.opening(None, CALC) == t.opening("calc", CALC) == "<calc>"
    with pytest.raises(APIError, match="needs exactly one tool with one parameter"):
        t.opening(None, CALC + [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {}}}}}])
    two = [{"type": "function", "function": {"name": "g", "parameters": {"type": "object",
                                                                        "properties": {"a": {}, "b": {}}}}}]
    with pytest.raises(APIError, match="'g' is not one"):
        t.opening("g", two)


@pytest.mark.parametrize("tools, choice, parser, error", [
    (TOOLS, {"type": "function", "function": {"name": "x"}}, "hermes", "tool_choice names 'x', which is not in tools"),
    (TOOLS, {"type": "function"}, "hermes", "a named tool_choice must be"),
    (TOOLS, "required", None, "tool calling needs a tool-call parser"),
    (TOOLS, "sometimes", "hermes", "tool_choice must be 'auto', 'none'"),
    (None, "auto", "hermes", "tool_choice is set but tools is not"),
    (TOOLS, None, None, "tool calling needs a tool-call parser: start treerl serve with --tool-call-parser"),
    ([{"type": "function"}], None, "hermes", "tools[0] must be"),
])
def test_tool_choice_refusals_name_the_field(tools, choice, parser, error):
    with pytest.raises(APIError, match=error.replace("(", r"\(").replace("[", r"\[")) as e:
        check_tool_choice(tools, choice, get_tool_format(parser) if parser else None)
    assert e.value.body()["error"]["param"] in ("tool_choice", "tools", "tools.0")


def test_tool_choice_defaults_follow_openai():
    h = get_tool_format("hermes")
    assert check_tool_choice(TOOLS, None, h) == ("auto", None) and check_tool_choice(None, None, h) == ("none", None)
    assert check_tool_choice(TOOLS, "none", None) == ("none", None)  # tools rendered, calls not parsed (vLLM)
    assert check_tool_choice(TOOLS, "required", h) == ("required", None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(TOOLS, named, h) == ("function", "get_weather")


# ------------------------------------------------------------------ rendering
def _request(**body) -> ChatRequest:
    req = ChatRequest.model_validate({"model": "treerl", **body})
    req.check()
    return req


def test_whole_messages_reach_the_template_with_arguments_as_dicts():
    tok = chat_tokenizer()
    history = [{"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "Paris?"}]},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages = template_messages(_request(messages=history, tools=TOOLS).messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = render_chat(tok, messages, TOOLS)
    assert "<|im_start|>user\nWeather\nParis?<|im_end|>" in text  # text parts joined with newlines (vLLM)
    assert "<|im_start|>assistant\n<tool_call>" + CALL_WHOLE + "</tool_call><|im_end|>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "get_weather", "description"' in text
    for bad, param in [({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
                        "messages.0.tool_calls.0.function.arguments"),
                       ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
                        "messages.0.tool_calls.0"),
                       ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                        "messages.0.content")]:
        with pytest.raises(APIError) as e:
            template_messages(_request(messages=[bad]).messages)
        assert e.value.body()["error"]["param"] == param


def test_chat_template_kwargs_reach_the_template_and_unread_ones_are_refused(weather):
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking=false``: an empty think block after
    the generation prompt) over HTTP: the prompt holds what the template made of it; a variable the
    template never reads is a 400 naming it, not silently ignored."""
    exact, _, tok = weather

    async def main():
        c = _client(exact)
        kw = dict(model="treerl", messages=[{"role": "user", "content": "Weather?"}], max_tokens=1)
        plain = await c.chat.completions.create(**kw)
        off = await c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        on = await c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"thinking_budget": 3}})
        tooled = await c.chat.completions.create(**kw, tools=TOOLS, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}})
        root = exact.url.removesuffix("/v1")
        tokenized = (await c._client.post(root + "/tokenize", json={  # the chat endpoint's prompt, tools and all
            "messages": kw["messages"], "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}})).json()
        await c.close()
        assert tokenized["tokens"] == tooled.model_extra["prompt_token_ids"]
        return plain, off, on, e.value.body

    plain, off, on, err = asyncio.run(main())
    p0, p1 = plain.model_extra["prompt_token_ids"], off.model_extra["prompt_token_ids"]
    assert p1[: len(p0)] == p0 and tok.decode(p1[len(p0):]) == "<think>\n\n</think>\n\n"
    assert on.model_extra["prompt_token_ids"] == p0
    assert err["param"] == "chat_template_kwargs.thinking_budget" and "never reads" in err["message"]


def test_a_template_without_tools_refuses_them():
    tok = chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    with pytest.raises(APIError, match="chat template does not render tools") as e:
        ChatRenderer(tok, "hermes").prompt(_request(messages=[{"role": "user", "content": "hi"}], tools=TOOLS))
    assert e.value.body()["error"]["param"] == "tools"
    assert ChatRenderer(tok, "hermes").prompt(_request(messages=[{"role": "user", "content": "hi"}])).ids


def test_marker_layout_writes_calls_in_the_servers_format():
    tok = CharTokenizer()
    history = [{"role": "user", "content": "3*4"},
               {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                   "name": "calc", "arguments": '{"expression": "3*4"}'}}]},
               {"role": "tool", "tool_call_id": "c", "content": "<result>12</result>"}]
    chat = ChatRenderer(tok, "tag")
    turn = chat.prompt(_request(messages=history, tools=CALC))
    assert tok.decode(turn.ids) == "<|bos|><|user|>3*4<|assistant|><calc>3*4</calc><|eos|><|tool|><result>12</result>" \
                                   "<|assistant|>"
    with pytest.raises(APIError, match="start treerl serve with --tool-call-parser"):
        ChatRenderer(tok).prompt(_request(messages=history))


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def weather():
    """(server with hermes and token-exact histories, server with histories off, tokenizer)."""
    tok = chat_tokenizer()
    servers = [ServerThread(make_state(RolloutEngine(tool_call_model(tok)), tok, ServeOptions(
        default_max_tokens=8, tool_call_parser="hermes", history_tokens=h))).start() for h in (1 << 16, 0)]
    yield *servers, tok
    for s in servers:
        s.stop()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0)


def test_openai_client_gets_tool_calls_and_the_next_turn_extends_the_produced_tokens(weather):
    exact, off, tok = weather
    ids = tok.convert_tokens_to_ids

    async def episode(server):
        c = _client(server)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r1 = await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, temperature=0)
        call = r1.choices[0].message.tool_calls[0]
        messages += [r1.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        r2 = await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, temperature=0)
        health = (await c._client.get(server.url.removesuffix("/v1") + "/health")).json()
        await c.close()
        return r1, r2, health

    r1, r2, health = asyncio.run(episode(exact))
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL["arguments"]
    p1, c1 = r1.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert '"name": "get_weather", "description"' in tok.decode(p1)  # the tools are in the prompt
    produced = [ids("<tool_call>"), ids(CALL_HEAD), ids(CALL_TAIL), ids("</tool_call>"), ids("<|im_end|>")]
    assert c1 == produced
    # turn 2: the history's call is in the prompt as the model produced it, token for token
    p2 = r2.model_extra["prompt_token_ids"]
    assert p2[: len(p1) + len(c1)] == p1 + c1
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in tok.decode(p2[len(p1) + len(c1):])
    assert health["chat"]["history"] | {"exact_share": 1.0} == {"requests": 1, "turns": 1, "exact": 1, "rewritten": 0,
                                                                "unknown": 0, "exact_share": 1.0}
    assert health["chat"]["tool_calls"]["calls"] == 2

    # without token-exact histories the template's tokens replace the produced ones
    r1, r2, health = asyncio.run(episode(off))
    p1, c1, p2 = r1.model_extra["prompt_token_ids"], r1.choices[0].model_extra["token_ids"], \
        r2.model_extra["prompt_token_ids"]
    assert c1 == produced and p2[: len(p1) + len(c1)] != p1 + c1
    assert p2[len(p1): len(p1) + 3] == [ids("<tool_call>"), ids(CALL_WHOLE), ids("</tool_call>")]  # holds the call
    assert health["chat"]["history"]["unknown"] == 1


def test_tool_choice_none_malformed_text_and_refusals_over_http(weather):
    exact, _, tok = weather

    async def main():
        c = _client(exact)
        messages = [{"role": "user", "content": "Weather?"}]
        none = await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, tool_choice="none")
        # cut after two tokens: an unfinished call is returned as content, counted, never a 500
        cut = await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, max_tokens=2)
        errors = []
        for kw in [dict(tool_choice={"type": "function", "function": {"name": "x"}})]:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS, **kw)
            errors.append(e.value.body["param"])
        health = (await c._client.get(exact.url.removesuffix("/v1") + "/health")).json()
        await c.close()
        return none, cut, errors, health

    before = exact.state.chat.stats()["tool_calls"]["malformed"]
    none, cut, errors, health = asyncio.run(main())
    assert none.choices[0].finish_reason == "stop" and none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == "<tool_call>" + CALL_WHOLE + "</tool_call>"
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content == "<tool_call>" + CALL_HEAD
    assert health["chat"]["tool_calls"]["malformed"] == before + 1
    assert errors == ["tool_choice"]


def test_forced_tool_calls_over_http_hold_the_opening_in_the_completion(weather):
    """tool_choice "required" and a named function: the call's opening is forced (appended to
    the prompt) and is the completion's first tokens, with the model's logprobs (here equal to
    those of the same tokens sampled freely); the prompt is the conversation's, and the next
    turn extends prompt + completion token for token. A forced call of a tool the request does
    not offer is returned as content and counted in /metrics."""
    exact, _, tok = weather
    ids = tok.convert_tokens_to_ids
    named = {"type": "function", "function": {"name": "get_weather"}}
    other = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]

    async def main():
        c = _client(exact)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        out = {}
        for label, kw in [("auto", {}), ("required", dict(tool_choice="required")), ("named", dict(tool_choice=named))]:
            out[label] = await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS,
                                                         temperature=0, **kw)
        r1 = out["named"]
        call = r1.choices[0].message.tool_calls[0]
        turn2 = messages + [r1.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        out["turn2"] = await c.chat.completions.create(model="treerl", messages=turn2, tools=TOOLS, temperature=0)
        out["unknown"] = await c.chat.completions.create(model="treerl", messages=messages, tools=other,
                                                         tool_choice="required", temperature=0)
        metrics = (await c._client.get(exact.url.removesuffix("/v1") + "/metrics")).text
        await c.close()
        return out, metrics

    before = exact.state.chat.stats()["tool_calls"]
    out, metrics = asyncio.run(main())
    produced = [ids("<tool_call>"), ids(CALL_HEAD), ids(CALL_TAIL), ids("</tool_call>"), ids("<|im_end|>")]
    auto = out["auto"].choices[0].model_extra
    for label, forced in [("required", 1), ("named", 2)]:
        r = out[label]
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, label
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == CALL["arguments"]
        assert choice.model_extra["token_ids"] == produced  # the forced opening, then the model's tokens
        assert r.model_extra["prompt_token_ids"] == out["auto"].model_extra["prompt_token_ids"]
        lps, versions = choice.model_extra["token_logprobs"], choice.model_extra["token_versions"]
        assert len(lps) == len(versions) == len(produced) and versions == [0] * len(produced)
        assert lps == pytest.approx(auto["token_logprobs"], rel=1e-4, abs=1e-5)
        assert r.usage.completion_tokens == len(produced) and r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"])
    p1, c1 = out["named"].model_extra["prompt_token_ids"], out["named"].choices[0].model_extra["token_ids"]
    assert out["turn2"].model_extra["prompt_token_ids"][: len(p1) + len(c1)] == p1 + c1
    unknown = out["unknown"].choices[0]
    assert unknown.finish_reason == "stop" and unknown.message.tool_calls is None
    assert unknown.message.content == "<tool_call>" + CALL_WHOLE + "</tool_call>"
    after = exact.state.chat.stats()["tool_calls"]
    assert (after["forced"] - before["forced"], after["malformed"] - before["malformed"]) == (3, 1)
    assert f"treerl_chat_tool_calls_malformed_total {float(after['malformed'])}" in metrics
    assert f"treerl_chat_tool_calls_forced_total {float(after['forced'])}" in metrics


def test_treerl_serve_refuses_an_unknown_tool_call_parser():
    from treerl.cli import parser

    args = parser().parse_args(["serve", "--tool-call-parser", "nope"])
    with pytest.raises(SystemExit, match="--tool-call-parser: unknown tool-call parser 'nope'; choose one of"):
        args.func(args)


def test_treerl_serve_command_parses_tool_calls_of_a_hugging_face_model_dir(serve_commands):
    import signal

    # `treerl serve --weights <HF dir of tool_call_model> --port 0 --tool-call-parser hermes
    # --history-tokens 0 --max-tokens 8`, started with the first serve test (tests/serve/conftest.py)
    proc = serve_commands["test_treerl_serve_command_parses_tool_calls_of_a_hugging_face_model_dir"]
    try:
        line = ""
        while "listening on" not in line:
            line = proc.stderr.readline()
            assert line, "treerl serve exited before listening"
        url = line.split("listening on ")[1].split()[0]

        async def main():
            c = openai.AsyncOpenAI(base_url=url, api_key="x", timeout=60)
            messages = [{"role": "user", "content": "Weather?"}]
            r = await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS)
            messages += [r.choices[0].message, {"role": "tool", "tool_call_id": "x", "content": "sunny"}]
            await c.chat.completions.create(model="treerl", messages=messages, tools=TOOLS)
            health = (await c._client.get(url.removesuffix("/v1") + "/health")).json()
            await c.close()
            return r, health

        r, health = asyncio.run(main())
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == CALL["arguments"]
        assert health["chat"]["history"]["unknown"] == 1  # --history-tokens 0: the record is off
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_openai_agents_sdk_function_tool_runs_through_treerl_serve(weather):
    """An `openai-agents` agent with a ``@function_tool`` (the SDK's chat-completions model):
    its first call gets the tool call, the SDK runs the function, and its next request (the
    history with the call and the tool output) extends the first token for token."""
    sdk = pytest.importorskip("agents")
    exact, _, _ = weather
    sdk.set_tracing_disabled(True)
    seen = []

    @sdk.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "sunny"

    async def main():
        client = openai.AsyncOpenAI(base_url=exact.url, api_key="x", max_retries=0)
        model = sdk.OpenAIChatCompletionsModel(model="treerl", openai_client=client)
        agent = sdk.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
                          tool_use_behavior="stop_on_first_tool")
        first = await sdk.Runner.run(agent, "Weather in Paris?")
        before = exact.state.chat.stats()["history"]
        # run the model again after the tool: the lookup model calls again, so stop at 2 turns
        with pytest.raises(sdk.MaxTurnsExceeded):
            await sdk.Runner.run(agent.clone(tool_use_behavior="run_llm_again"), "Weather in Paris?", max_turns=2)
        await client.close()
        return first, before, exact.state.chat.stats()["history"]

    first, before, after = asyncio.run(main())
    assert first.final_output == "sunny" and seen == ["Paris", "Paris", "Paris"]
    assert after["turns"] - before["turns"] == 1 and after["exact"] - before["exact"] == 1


def test_streamed_tool_calls_over_http_are_the_whole_replys(weather):
    """Streamed with tools, as answered whole: the same tokens (a forced opening first, scored the
    same), the same calls and finish reason, no call markup as content; a cut call (malformed) comes
    as the same content; and turn 2 after a streamed call extends its prompt + completion token for
    token (the history recorded)."""
    exact, _, tok = weather
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def main():
        c = _client(exact)
        kw = dict(model="treerl", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
                  temperature=0)
        out = {}
        for label, extra in [("auto", {}), ("required", dict(tool_choice="required")),
                             ("named", dict(tool_choice=named, logprobs=True, top_logprobs=2)),
                             ("cut", dict(max_tokens=2))]:
            whole = await c.chat.completions.create(**kw, **extra)
            chunks = [ch async for ch in await c.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw, **extra)]
            out[label] = whole, chunks
        whole, chunks = out["named"]
        call = next(x.delta.tool_calls for ch in chunks for x in ch.choices if x.delta.tool_calls)[0]
        turn1 = kw["messages"] + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]}]
        turn2 = await c.chat.completions.create(model="treerl", temperature=0, tools=TOOLS, messages=turn1 + [
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        await c.close()
        return out, chunks[0].model_extra["prompt_token_ids"], turn2

    out, p1, turn2 = asyncio.run(main())
    for label, (whole, chunks) in out.items():
        body = [x for ch in chunks for x in ch.choices]
        ref = whole.choices[0]
        assert [t for x in body for t in x.model_extra.get("token_ids", [])] == ref.model_extra["token_ids"], label
        lps = [t for x in body for t in x.model_extra.get("token_logprobs", [])]
        assert lps == pytest.approx(ref.model_extra["token_logprobs"], rel=1e-4, abs=1e-5), label
        assert "".join(x.delta.content or "" for x in body) == (ref.message.content or ""), label
        assert body[-1].finish_reason == ref.finish_reason, label
        assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"], label
        assert chunks[-1].usage == whole.usage, label
        if label == "cut":
            assert ref.finish_reason == "length" and ref.message.content.startswith("<tool_call>")
            continue
        assert ref.finish_reason == "tool_calls" and all(not x.delta.content for x in body)
        assert all(not x.delta.tool_calls for x in body[:-1])  # the calls come whole, in the last chunk
        got, want = body[-1].delta.tool_calls[0], ref.message.tool_calls[0]
        assert got.index == 0 and got.type == "function" and got.id.startswith("call_")
        assert (got.function.name, json.loads(got.function.arguments)) == (want.function.name,
                                                                           json.loads(want.function.arguments))
    named = [x for ch in out["named"][1] for x in ch.choices]
    assert [e.token for x in named if x.logprobs for e in x.logprobs.content][:1] == ["<tool_call>"]
    assert all(len(e.top_logprobs) == 2 for x in named if x.logprobs for e in x.logprobs.content)
    c1 = [t for x in named for t in x.model_extra.get("token_ids", [])]
    assert turn2.model_extra["prompt_token_ids"][: len(p1) + len(c1)] == p1 + c1


def test_streamed_content_without_a_call_keeps_what_the_text_stream_held_back():
    """A streamed reply with tools that holds no call: its content is the whole reply's, the tail
    the text stream held back for a stop string included (``parallel_tool_calls=false``'s end tag,
    the request's own stop string, ``tool_choice="none"``): the last chunk sends that tail."""
    from treerl.models import build_model

    tok = CharTokenizer()
    model = build_model("qwen3", "tiny", seed=0, max_position_embeddings=96, **tok.hf_config_kwargs())
    server = ServerThread(make_state(RolloutEngine(model), tok, ServeOptions(
        default_max_tokens=8, tool_call_parser="tag"))).start()

    async def main():
        c = _client(server)
        out = []
        for i in range(4):
            kw = dict(model="treerl", messages=[{"role": "user", "content": f"q{i}?"}], tools=CALC, temperature=0,
                      max_tokens=12)
            for extra in [dict(parallel_tool_calls=False), dict(stop=["qqqqqq"]),
                          dict(tool_choice="none", stop=["qqq"])]:
                whole = await c.chat.completions.create(**kw, **extra)
                chunks = [ch async for ch in await c.chat.completions.create(stream=True, **kw, **extra)]
                out.append((extra, whole.choices[0], [x for ch in chunks for x in ch.choices]))
        await c.close()
        return out

    try:
        out = asyncio.run(main())
    finally:
        server.stop()
    for extra, ref, body in out:
        assert "".join(x.delta.content or "" for x in body) == (ref.message.content or ""), extra
        assert bool(body[-1].delta.tool_calls) == bool(ref.message.tool_calls), extra
    assert sum(len(ref.message.content or "") >= 7 and not ref.message.tool_calls for _, ref, _ in out) >= 6


def test_parallel_tool_calls_false_stops_after_the_first_call(weather):
    """``parallel_tool_calls=false`` (the openai-agents SDK's ``ModelSettings(parallel_tool_calls=False)``):
    the generation stops at the first call's end tag (its stop string), so a reply holds one call;
    the tag is parsed with the call and its tokens are the completion's, so the next turn extends
    prompt + completion token for token; streamed the same."""
    exact, _, tok = weather
    ids = tok.convert_tokens_to_ids

    async def main():
        c = _client(exact)
        kw = dict(model="treerl", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
                  temperature=0, parallel_tool_calls=False)
        r1 = await c.chat.completions.create(**kw)
        chunks = [ch async for ch in await c.chat.completions.create(**kw, stream=True)]
        call = r1.choices[0].message.tool_calls[0]
        r2 = await c.chat.completions.create(**kw | dict(messages=kw["messages"] + [
            r1.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "cold"}]))
        await c.close()
        return r1, chunks, r2

    r1, chunks, r2 = asyncio.run(main())
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.model_extra["stop_reason"] == "</tool_call>"
    assert len(choice.message.tool_calls) == 1 and json.loads(choice.message.tool_calls[0].function.arguments) == \
        CALL["arguments"]
    assert choice.model_extra["token_ids"] == [ids("<tool_call>"), ids(CALL_HEAD), ids(CALL_TAIL), ids("</tool_call>")]
    body = [x for ch in chunks for x in ch.choices]
    assert [t for x in body for t in x.model_extra.get("token_ids", [])] == choice.model_extra["token_ids"]
    assert body[-1].finish_reason == "tool_calls" and body[-1].delta.tool_calls[0].function.name == "get_weather"
    p1, c1 = r1.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert r2.model_extra["prompt_token_ids"][: len(p1) + len(c1)] == p1 + c1


def test_a_reply_stopped_at_a_calls_end_is_parsed_with_it():
    """The end tag a ``parallel_tool_calls=false`` stop trims is put back before parsing: the tag
    format needs its closing tag (``<calc>1+1`` alone is malformed)."""
    renderer = ChatRenderer(CharTokenizer(), "tag", history_tokens=0)
    req = ChatRequest(model="m", messages=[{"role": "user", "content": "1+1?"}], tools=CALC, parallel_tool_calls=False)
    turn = renderer.prompt(req)
    assert turn.call_ends == ("</calc>",)
    message, finish = renderer.reply(turn, "<calc>1+1", "stop", [], "</calc>")
    assert finish == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "expression": "1+1"}
    assert renderer.reply(turn, "<calc>1+1", "length", [], None)[0]["content"] == "<calc>1+1"  # cut: content
    two = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}, "b": {}}}}}]
    no_call = ChatRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=two, parallel_tool_calls=False)
    assert renderer.prompt(no_call).call_ends == ()  # the tag format can call no such tool: at most one call holds

    class Unbounded(ToolFormat):  # a format that cannot say where a call ends
        name = "unbounded"

        def parse(self, text, tools):
            return None

    renderer.tool_format = Unbounded()
    with pytest.raises(APIError, match="parallel_tool_calls"):
        renderer.prompt(req)
