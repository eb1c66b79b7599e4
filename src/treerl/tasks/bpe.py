"""A small byte-level BPE tokenizer with a ChatML chat template, built locally (no
download), for tests and smoke runs that need a real Hugging Face tokenizer: multi-byte
characters split over tokens, special tokens, ``apply_chat_template``, ``save_pretrained``."""

from __future__ import annotations

from typing import Iterable

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Question: what is 12 plus 7? Answer: 19", "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.", "def add(a, b):\n    return a + b",
    "naïve café — résumé, über, ✓ ☃ 日本語", "one two three four five six seven eight nine ten",
]


def tiny_bpe_tokenizer(vocab_size: int = 384, corpus: Iterable[str] = CORPUS):
    """A ``PreTrainedTokenizerFast``: byte-level BPE (every string encodes; ids below 256 + 3
    specials are bytes and specials) trained on ``corpus``, eos ``<|endoftext|>``, ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) * 4, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:])
    out.chat_template = CHATML
    return out
