"""A character-level tokenizer for tiny models trained on the built-in tasks.

Ids: the special tokens first, in :data:`SPECIAL_TOKENS` order (pad=0, bos=1, eos=2,
then the chat markers user=3, assistant=4, tool=5), then one id per alphabet character.
Special tokens are written ``<|name|>`` in text; :meth:`CharTokenizer.encode` recognises
them (longest match first, like Hugging Face tokenizers) before falling back to single
characters, so ``decode(encode(s)) == s`` for every string over the alphabet.

The method names mirror the Hugging Face tokenizer API where it is cheap to do so
(``encode(..., add_special_tokens=)``, ``decode(..., skip_special_tokens=)``,
``save_pretrained`` / ``from_pretrained``, ``pad_token_id`` ...), so code written
against a Hugging Face tokenizer works with this one.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field
from typing import Iterable, Sequence

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
)
FILE_NAME = "treerl_char_tokenizer.json"
_FORMAT = "treerl.CharTokenizer"
_FORMAT_VERSION = 1

#: Printable ASCII (letters, digits, punctuation, space, newline): covers every built-in task.
DEFAULT_ALPHABET: str = string.digits + string.ascii_letters + string.punctuation + " \n"


@dataclass(frozen=True)
class CharTokenizer:
    """One token per character of ``alphabet``, plus the special tokens.

    ``alphabet`` must not repeat a character; order fixes the ids.
    """

    alphabet: str = DEFAULT_ALPHABET
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS
    _char_to_id: dict = field(init=False, repr=False, compare=False)
    _special_to_id: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.alphabet, str) or not self.alphabet:
            raise ValueError("CharTokenizer: alphabet must be a non-empty string")
        seen: set[str] = set()
        for ch in self.alphabet:
            if ch in seen:
                raise ValueError(f"CharTokenizer: character {ch!r} appears twice in the alphabet")
            seen.add(ch)
        specials = tuple(self.special_tokens)
        if specials[:3] != SPECIAL_TOKENS[:3]:
            raise ValueError(f"CharTokenizer: special tokens must start with {SPECIAL_TOKENS[:3]}")
        if len(set(specials)) != len(specials) or any(len(s) < 2 for s in specials):
            raise ValueError("CharTokenizer: special tokens must be distinct, at least 2 characters")
        object.__setattr__(self, "special_tokens", specials)
        object.__setattr__(self, "_special_to_id", {s: i for i, s in enumerate(specials)})
        n = len(specials)
        object.__setattr__(self, "_char_to_id", {c: n + i for i, c in enumerate(self.alphabet)})

    # ------------------------------------------------------------------ sizes / ids
    @property
    def vocab_size(self) -> int:
        return len(self.special_tokens) + len(self.alphabet)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    def _special_id(self, name: str) -> int | None:
        return self._special_to_id.get(f"<|{name}|>")

    @property
    def user_token_id(self) -> int | None:
        return self._special_id("user")

    @property
    def assistant_token_id(self) -> int | None:
        return self._special_id("assistant")

    @property
    def tool_token_id(self) -> int | None:
        return self._special_id("tool")

    @property
    def pad_token(self) -> str:
        return self.special_tokens[0]

    @property
    def bos_token(self) -> str:
        return self.special_tokens[1]

    @property
    def eos_token(self) -> str:
        return self.special_tokens[2]

    @property
    def all_special_ids(self) -> list[int]:
        return list(range(len(self.special_tokens)))

    def get_vocab(self) -> dict[str, int]:
        return {**self._special_to_id, **self._char_to_id}

    def hf_config_kwargs(self) -> dict[str, int]:
        """Keyword arguments for a Hugging Face model config (``vocab_size`` and special ids)."""
        return {
            "vocab_size": self.vocab_size,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }

    # ------------------------------------------------------------------ encode / decode
    def encode(
        self,
        text: str,
        add_special_tokens: bool = False,
        *,
        add_bos: bool | None = None,
        add_eos: bool = False,
        parse_special: bool = True,
    ) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``/``add_bos`` prepend bos.

        Raises ``ValueError`` naming the first character not in the alphabet.
        """
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.encode expects a str, got {type(text).__name__}")
        bos = add_special_tokens if add_bos is None else add_bos
        ids: list[int] = [self.bos_token_id] if bos else []
        specials = sorted(self.special_tokens, key=len, reverse=True) if parse_special else ()
        i, n = 0, len(text)
        while i < n:
            if parse_special and text.startswith("<|", i):
                for s in specials:
                    if text.startswith(s, i):
                        ids.append(self._special_to_id[s])
                        i += len(s)
                        break
                else:
                    ids.append(self._char_id(text, i))
                    i += 1
                continue
            ids.append(self._char_id(text, i))
            i += 1
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def _char_id(self, text: str, i: int) -> int:
        ch = text[i]
        tid = self._char_to_id.get(ch)
        if tid is None:
            shown = text if len(text) <= 40 else text[:37] + "..."
            raise ValueError(
                f"CharTokenizer: character {ch!r} (U+{ord(ch):04X}) at position {i} of {shown!r} "
                f"is not in the alphabet {self.alphabet!r}"
            )
        return tid

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        """Hugging Face style: ``{"input_ids": [...]}``."""
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        specials, alphabet, n = self.special_tokens, self.alphabet, len(self.special_tokens)
        out = []
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < self.vocab_size:
                raise ValueError(f"CharTokenizer: token id {tid} is outside the vocabulary [0, {self.vocab_size})")
            out.append(specials[tid] if tid < n else alphabet[tid - n])
        return out

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        vocab = self.get_vocab()
        if isinstance(tokens, str):
            if tokens not in vocab:
                raise ValueError(f"CharTokenizer: unknown token {tokens!r}")
            return vocab[tokens]
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ``skip_special_tokens`` drops pad/bos/eos and the chat markers."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()  # tensors / arrays
        n = len(self.special_tokens)
        toks = self.convert_ids_to_tokens(ids)
        if skip_special_tokens:
            return "".join(t for t, i in zip(toks, ids) if int(i) >= n)
        return "".join(toks)

    def batch_decode(self, batch: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    # ------------------------------------------------------------------ save / load
    def to_dict(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "alphabet": self.alphabet,
            "special_tokens": list(self.special_tokens),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CharTokenizer":
        if data.get("format") != _FORMAT:
            raise ValueError(f"not a CharTokenizer file (format={data.get('format')!r})")
        if data.get("version") != _FORMAT_VERSION:
            raise ValueError(f"unsupported CharTokenizer file version {data.get('version')!r}")
        return cls(alphabet=data["alphabet"], special_tokens=tuple(data["special_tokens"]))

    def save_pretrained(self, directory: str | os.PathLike) -> str:
        """Write ``treerl_char_tokenizer.json`` into ``directory`` (created if needed); return its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, FILE_NAME)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, ensure_ascii=False, indent=1)
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "CharTokenizer":
        """Load a tokenizer written by :meth:`save_pretrained`."""
        path = os.path.join(directory, FILE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no CharTokenizer here (expected {FILE_NAME})")
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: invalid JSON ({e.msg}, line {e.lineno})") from None
        try:
            return cls.from_dict(data)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    @staticmethod
    def is_saved_in(directory: str | os.PathLike) -> bool:
        """Whether ``directory`` holds a saved CharTokenizer (to choose it over an HF tokenizer)."""
        return os.path.isfile(os.path.join(directory, FILE_NAME))
