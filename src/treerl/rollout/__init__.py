"""treerl.rollout: the embedded rollout (generation) engine.

Batched sampling with a shared-prefix KV cache from a Hugging Face causal LM, on one path,
continuous batching (``RolloutEngine.generate_stream`` with a ``PromptQueue``; ``generate``
collects it): groups come out as they finish while new prompts take the freed slots. Each
prompt is prefilled once and its K/V stored once and read once per decode step for all its
samples; tree rollouts (forks at chosen completion lengths) store each fork point's tokens
once for the rows below it (attention over the levels merged by log-sum-exp); rows keep
their own tokens in K/V blocks they take as they grow (admission by free blocks; groups
preempted and recomputed later when blocks run out); a token-keyed LRU prefix cache lets
a prompt that extends an earlier one (the next turn of an episode) prefill only its new
tokens; temperature/top-k/top-p/min-p, stop tokens and strings, max new tokens, seeds, per
group in one running batch (``PromptQueue.put(params=...)``, ``generate`` with a list);
streamed tokens (``TokenDelta`` listeners) and cancellation; per-token behaviour logprobs
(and top-k alternatives) and weight versions; in-process weight updates.
"""

from .engine import RolloutEngine
from .build import build_rollout_engine
from .kv import SlotCache, rollout_attention
from .prefix_cache import PrefixCache
from .shared import SharedPrefixCache, fork_attention, two_level_attention
from .params import SamplingParams
from .prompts import PromptQueue
from .forks import ForkLayout
from .types import Completion, Group, RolloutStats, TokenDelta
from .sampling import apply_top_k, apply_top_p, sample, sampling_distribution
from .stops import StopChecker

__all__ = [
    "RolloutEngine",
    "build_rollout_engine",
    "SamplingParams",
    "Completion",
    "TokenDelta",
    "Group",
    "RolloutStats",
    "PromptQueue",
    "SlotCache",
    "SharedPrefixCache",
    "PrefixCache",
    "two_level_attention",
    "fork_attention",
    "ForkLayout",
    "StopChecker",
    "apply_top_k",
    "apply_top_p",
    "sample",
    "sampling_distribution",
    "rollout_attention",
]
