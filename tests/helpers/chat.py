"""A Qwen-like chat setup built locally for the tool-calling and history tests: a byte-level
BPE tokenizer (``tokenizers``, trained here on a few lines) with a ChatML template that
renders tools, tool calls and tool responses as the Qwen2.5 template does and drops earlier
turns' ``<think>`` reasoning as Qwen3's does; and a tiny Qwen3 whose weights make greedy
decoding emit one fixed tool call (a lookup from the last token: every decoder block's
output projections are zero, so the residual stream is the token's embedding).

The call text has two tokenizations: the canonical one (``CALL_WHOLE``, what encoding the
rendered text gives) and the one the model emits (``CALL_HEAD`` + ``CALL_TAIL``), as a sampled
BPE model often emits non-canonical tokens for text it writes."""

from __future__ import annotations

import json

import torch

from treerl.models import build_model

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
CALL_JSON = json.dumps(CALL)
CALL_WHOLE = "\n" + CALL_JSON + "\n"
CALL_HEAD = '\n{"name": "get_weather", '
CALL_TAIL = '"arguments": {"city": "Paris"}}\n'
assert CALL_HEAD + CALL_TAIL == CALL_WHOLE
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nCall a tool as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}
{%- if '</think>' in content and loop.index0 < ns.last_user %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' + content }}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

CORPUS = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
          "<|im_start|>user\nWhat is the weather in Paris today?<|im_end|>\n",
          "<|im_start|>assistant\nIt is sunny in Paris, 21 degrees.<|im_end|>\n",
          '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city."}}',
          "<tool_response>\nsunny, 21 C\n</tool_response> Paris London Berlin the weather is"] * 4


def chat_tokenizer():
    """The byte-level BPE tokenizer with the ChatML tool template (eos ``<|im_end|>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>", CALL_WHOLE, CALL_HEAD, CALL_TAIL)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = TEMPLATE
    return out


def tool_call_model(tok, hidden: int = 64, context: int = 512) -> torch.nn.Module:
    """A tiny Qwen3 whose greedy continuation of any chat prompt (ending ``assistant\\n``) is
    ``<tool_call> CALL_HEAD CALL_TAIL </tool_call> <|im_end|>``; after any other token it
    emits ``<|im_end|>``."""
    ids = tok.convert_tokens_to_ids
    nl = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    chain = [nl, ids("<tool_call>"), tok.convert_tokens_to_ids(CALL_HEAD), ids(CALL_TAIL), ids("</tool_call>"),
             ids("<|im_end|>")]
    assert len(set(chain)) == len(chain)
    V = len(tok)
    model = build_model("qwen3", "tiny", vocab_size=V, hidden_size=hidden, tie_word_embeddings=False,
                        max_position_embeddings=context, eos_token_id=ids("<|im_end|>"), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the residual stream stays the input embedding
        E = torch.randn(V, hidden, generator=g) * 0.1
        E[:, : len(chain)] = 0
        E[:, 0] = 1.0  # every token: a constant direction read by <|im_end|>'s row
        W = torch.zeros(V, hidden)
        W[chain[-1], 0] = 3.0
        for k, (a, b) in enumerate(zip(chain[:-1], chain[1:]), start=1):
            E[a] = 0
            E[a, 0], E[a, k] = 1.0, 4.0
            W[b, k] = 10.0
        model.model.embed_tokens.weight.copy_(E)
        model.lm_head.weight.copy_(W)
    model.train(False)
    return model
