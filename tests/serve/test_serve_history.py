"""Token-exact histories (treerl.serve.history through treerl.serve.chat): a recorded turn is
spliced in where the template renders it unchanged; a template that rewrites history (drops
earlier reasoning), an edited history, an evicted record and the record switched off give the
template's tokens, and each case is counted. (End to end through the `openai` client:
tests/serve/test_serve_tools.py.)"""

from __future__ import annotations

import pytest
from helpers.chat import CALL_HEAD, CALL_TAIL, chat_tokenizer

from treerl.serve.chat import ChatRenderer
from treerl.serve.history import TokenHistory
from treerl.serve.protocol import ChatRequest


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def _req(messages, **kw) -> ChatRequest:
    r = ChatRequest.model_validate({"model": "treerl", "messages": messages, **kw})
    r.check()
    return r


def _reply(chat: ChatRenderer, tok, messages, produced_text: str, produced_ids=None, finish="stop"):
    """One served turn with a given completion: its prompt ids, completion ids and message."""
    turn = chat.prompt(_req(messages))
    ids = produced_ids if produced_ids is not None else tok.encode(produced_text, add_special_tokens=False)
    ids = list(ids) + [tok.eos_token_id]
    message, _ = chat.reply(turn, tok.decode(ids, skip_special_tokens=True), finish, ids)
    return turn.ids, ids, message


def _bytes_of(tok, text: str) -> list[int]:
    """``text`` one byte-level token per character (a non-canonical tokenization)."""
    out = []
    for ch in text:
        out += tok.encode(ch, add_special_tokens=False)
    return out


def test_a_turn_rendered_unchanged_keeps_the_produced_tokens_over_several_turns(tok):
    chat = ChatRenderer(tok)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    chain = []
    for k, text in enumerate(["It is sunny in Paris.", "21 degrees.", "the weather is sunny"]):
        produced = _bytes_of(tok, text)
        assert produced != tok.encode(text, add_special_tokens=False)  # re-tokenizing would change them
        prompt, completion, message = _reply(chat, tok, messages, text, produced)
        if chain:
            assert prompt[: len(chain)] == chain  # extends the previous prompt + completion token for token
        chain = prompt + completion
        messages += [message, {"role": "user", "content": f"and {k}?"}]
    assert chat.stats()["history"] | {"exact_share": 1} == {"requests": 2, "turns": 3, "exact": 3, "rewritten": 0,
                                                            "unknown": 0, "exact_share": 1}
    # the same conversation without the record: the template's (canonical) tokens
    plain = ChatRenderer(tok, history_tokens=0).prompt(_req(messages)).ids
    assert plain == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)
    assert plain[: len(chain)] != chain


def test_a_template_that_drops_earlier_reasoning_is_counted_as_rewritten(tok):
    chat = ChatRenderer(tok)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = "<think>\nthe weather\n</think>\n\nIt is sunny."
    prompt, completion, message = _reply(chat, tok, messages, text)
    # a tool turn keeps the reasoning (no new user message): exact
    with_tool = messages + [message, {"role": "tool", "content": "sunny"}]
    assert chat.prompt(_req(with_tool)).ids[: len(prompt) + len(completion)] == prompt + completion
    # a new user message: the template drops the earlier turn's reasoning; its tokens are gone
    rewritten = messages + [message, {"role": "user", "content": "and London?"}]
    ids = chat.prompt(_req(rewritten)).ids
    assert "<think>" not in tok.decode(ids)
    assert ids == tok.encode(tok.apply_chat_template(rewritten, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
    h = chat.stats()["history"]
    assert (h["turns"], h["exact"], h["rewritten"], h["exact_share"]) == (2, 1, 1, 0.5)


def test_tool_call_turns_edited_histories_and_eviction(tok):
    chat = ChatRenderer(tok, "hermes")
    ids = tok.convert_tokens_to_ids
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    produced = [ids("<tool_call>"), ids(CALL_HEAD), ids(CALL_TAIL), ids("</tool_call>")]
    turn = chat.prompt(_req(messages, tools=[]))
    completion = produced + [tok.eos_token_id]
    message, finish = chat.reply(turn, tok.decode(completion, skip_special_tokens=True), "stop", completion)
    assert finish == "stop" and "tool_calls" not in message  # tools=[]: nothing parsed
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    turn = chat.prompt(_req(messages, tools=tools))
    message, finish = chat.reply(turn, tok.decode(completion, skip_special_tokens=True), "stop", completion)
    assert finish == "tool_calls"
    # the client sends the arguments back re-serialised (other spacing): the same call
    sent = dict(message, tool_calls=[dict(message["tool_calls"][0], function={
        "name": "get_weather", "arguments": '{"city":"Paris"}'})])
    history = messages + [sent, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sunny"}]
    assert chat.prompt(_req(history, tools=tools)).ids[: len(turn.ids) + len(completion)] == turn.ids + completion
    # an edited earlier message: the record no longer applies (not found: counted unknown)
    edited = [{"role": "user", "content": "Weather in Rome?"}] + history[1:]
    before = chat.stats()["history"]["unknown"]
    assert chat.prompt(_req(edited, tools=tools)).ids[: len(turn.ids)] != turn.ids
    assert chat.stats()["history"]["unknown"] == before + 1


def test_the_record_is_bounded_by_tokens():
    h = TokenHistory(max_tokens=10)
    h.record(b"a", [1, 2, 3], [4, 5])
    h.record(b"b", [1, 2, 3], [6, 7])
    assert len(h) == 2
    h._get(b"a")  # used: b is now the least recently used
    h.record(b"c", [1, 2], [8])
    assert h._get(b"b") is None and h._get(b"a") is not None and h._get(b"c") is not None
    h.record(b"d", list(range(11)), [])  # larger than the record: not kept
    assert h._get(b"d") is None and len(h) == 2
    with pytest.raises(ValueError, match="history max_tokens must be >= 0"):
        TokenHistory(-1)
