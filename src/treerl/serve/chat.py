"""Chat messages -> prompt token ids.

A tokenizer with a chat template (Hugging Face, ``tokenizer.chat_template``) renders the
messages with ``apply_chat_template(..., add_generation_prompt=True)``. A tokenizer with
role-marker tokens and no template (:class:`~treerl.tasks.tokenizer.CharTokenizer`) uses
treerl's marker layout, the one :class:`~treerl.tasks.env.ChatFormat` gives multi-turn
environments::

    <bos> <user> first message  <assistant> reply <eos>  <tool> result  <assistant> ...

(system and developer messages use the user marker, later user messages too; tool
messages the tool marker; an assistant message ends with eos, as a generated one does).
So the prompt of the next call extends the previous call's prompt + completion token for
token when the reply ended with eos: an agent's turns form a chain in the prefix tree.
"""

from __future__ import annotations

from typing import Any, Sequence

from .protocol import APIError


def has_chat_format(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) or _markers(tokenizer) is not None


def _markers(tokenizer: Any) -> dict[str, int] | None:
    ids = {r: getattr(tokenizer, f"{r}_token_id", None) for r in ("user", "assistant", "tool")}
    return ids if all(i is not None for i in ids.values()) else None


def chat_prompt_ids(tokenizer: Any, messages: Sequence[tuple[str, str]]) -> list[int]:
    """Token ids of ``messages`` (``(role, text)`` pairs) followed by the generation prompt."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in messages],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:  # a BatchEncoding (transformers 5)
            out = out["input_ids"]
        return [int(t) for t in out]
    markers = _markers(tokenizer)
    if markers is None:
        raise APIError("this model's tokenizer has no chat template: use /v1/completions with a prompt", "messages")
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = [bos] if bos is not None else []
    for role, text in messages:
        marker = {"assistant": "assistant", "tool": "tool"}.get(role, "user")
        ids.append(markers[marker])
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if role == "assistant":
            ids.append(tokenizer.eos_token_id)
    ids.append(markers["assistant"])
    return ids
