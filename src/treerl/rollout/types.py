"""Types shared by the rollout engine's modules: what ``generate`` returns
(:class:`Completion`, :class:`Group`), what it did (:class:`RolloutStats`), and
:func:`round_up` (cache capacities), the K/V dtypes (:data:`KV_CACHE_DTYPES`). Below both :mod:`~treerl.rollout.engine` and
:mod:`~treerl.rollout.stream`, so neither imports the other's internals."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Hashable, Iterator, Sequence

import numpy as np
import torch

PromptLike = Sequence[int] | torch.Tensor | np.ndarray


def to_device(a, device: torch.device) -> torch.Tensor:
    """A host array (numpy array, list) as a tensor on ``device`` without a host sync: on
    CUDA through pinned memory, asynchronously (a copy from pageable memory first waits for
    all queued device work); the caching host allocator keeps the pinned copy until the
    transfer ran. On the CPU it may share ``a``'s memory (copy it before changing ``a``)."""
    t = torch.as_tensor(a if isinstance(a, np.ndarray) else np.asarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# the running batch's K/V dtype (RolloutEngine's kv_cache_dtype): None, the model's
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a K/V store of ``dtype`` holds it: each value rounded once, a float8 store's
    saturated at its largest finite value (as the Triton kernels' conversions do; torch's
    CUDA cast would give NaN past it)."""
    if dtype in FLOAT8 and x.dtype not in FLOAT8:
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's bytes (a ``uint8`` view; other tensors as they are): the stores'
    indexing (gathers, scattered writes) moves float8 values as bytes, which every device's
    index kernels handle."""
    return t.view(torch.uint8) if t.dtype in FLOAT8 else t


def round_up(n: int, multiple: int = 16) -> int:
    """Cache capacities are multiples of 16 (aligned rows for the attention kernels)."""
    return -(-n // multiple) * multiple


@dataclass
class Completion:
    """One sampled sequence. ``completion_ids``, ``logprobs`` and ``versions`` have one
    entry per generated token ``[T]``; ``logprobs`` are behaviour logprobs
    (log-softmax of the temperature-scaled logits before top-k/top-p; float64 for a
    float64 model, float32 otherwise)."""

    prompt_index: Hashable  # the prompt's index in ``generate``'s list, or its key in a stream
    prompt_ids: torch.Tensor  # [P] int64
    completion_ids: torch.Tensor  # [T] int64
    logprobs: torch.Tensor  # [T]
    versions: torch.Tensor  # [T] int64: weight version that produced each token
    finish_reason: str  # "stop", "length", or "abort" (cancelled: PromptQueue.cancel)
    stop: int | str | None  # the stop token id or stop string that ended it, else None
    branch: tuple[int, ...]  # sample index in the group, then child index at each fork passed
    # with SamplingParams.top_logprobs = k: the k most likely tokens at each step, ids [T, k] and
    # behaviour logprobs [T, k] (same distribution as ``logprobs``), most likely first; else None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def token_ids(self) -> torch.Tensor:
        """``[P + T]`` prompt followed by completion."""
        return torch.cat([self.prompt_ids, self.completion_ids])

    @property
    def min_version(self) -> int:
        """Oldest weight version among the completion's tokens (for staleness control)."""
        return int(self.versions.min()) if len(self.versions) else -1

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class TokenDelta:
    """New tokens of one row of a streamed group (``PromptQueue.put(listener=...)``): the
    group's key (``prompt_index``), the row's ``branch`` (its sample index, then its child
    index at each fork passed), the tokens that reached the host since the row's last
    delta with their behaviour ``logprobs`` and weight ``versions`` (``top_logprobs``: per
    token ``[(id, logprob)] x k`` when asked for, else None), and ``finish_reason`` (None
    while the row runs; ``"stop"``, ``"length"`` or ``"abort"`` in its last delta). A row's
    deltas concatenate to its completion."""

    prompt_index: Hashable
    branch: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None


@dataclass
class Group:
    """The completions of one prompt, ordered by ``branch``."""

    prompt_index: Hashable
    prompt_ids: torch.Tensor  # [P]
    completions: list[Completion]

    def sequences(self) -> list[torch.Tensor]:
        """Prompt + completion of every completion (e.g. for ``PrefixTree.from_sequences``)."""
        return [c.token_ids for c in self.completions]

    def __len__(self) -> int:
        return len(self.completions)

    def __iter__(self) -> Iterator[Completion]:
        return iter(self.completions)

    def __getitem__(self, i: int) -> Completion:
        return self.completions[i]


@dataclass
class RolloutStats:
    """What the last ``generate`` / ``generate_stream`` call did."""

    admissions: int = 0  # admission rounds (prompts prefilled into free group slots)
    admitted: int = 0  # prompt groups admitted (admitted / admissions: prompts per round)
    prefill_calls: int = 0
    prefill_tokens: int = 0  # real (unpadded) tokens prefilled, recomputes included
    prefill_graph_calls: int = 0  # of the prefill calls, those run in a fixed bucket (on CUDA: replayed graphs)
    prefill_graph_builds: int = 0  # prefill buckets captured as CUDA graphs
    decode_steps: int = 0  # batched one-token forwards
    decode_rows: int = 0  # sum of the batch sizes of those forwards
    live_rows: int = 0  # sum of the unfinished rows of those forwards
    forks: int = 0  # rows forked (one per parent row and fork point)
    generated_tokens: int = 0  # tokens in the returned completions
    recomputes: int = 0  # KV recomputations after a weight update
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    contexts_kept: int = 0  # finished rows' contexts (prompt + completion) put into the prefix cache
    reallocations: int = 0  # running batch rebuilt for a longer prompt
    preemptions: int = 0  # groups preempted (own K/V blocks ran out), re-queued and recomputed later
    prefix_grows: int = 0  # prompt store grown in place for a longer prompt (decode steps rebuilt)
    step_builds: int = 0  # decode steps built (on CUDA: one graph capture each)
    kv_slots: int = 0  # most K/V token slots held (prompt stores + fork segments + own-block pool)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: "RolloutStats") -> None:
        """Add ``other``'s counters to these (``kv_slots``: the larger)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(a, b) if f.name == "kv_slots" else a + b)
