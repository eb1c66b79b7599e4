"""treerl.rollout: the embedded rollout (generation) engine.

Batched sampling with a shared-prefix KV cache from a Hugging Face causal LM: each
prompt is prefilled once and, on the continuous-batching path, its K/V stored once and
read once per decode step for its G samples (two-level attention merged by log-sum-exp);
a token-keyed LRU prefix cache lets a prompt that extends an earlier one prefill only its
new tokens; temperature/top-k/top-p,
stop tokens and strings, max new tokens; tree rollouts (forks at chosen completion
lengths); per-token behaviour logprobs and weight versions; in-process weight updates;
continuous batching (``RolloutEngine.generate_stream`` with a ``PromptQueue``): groups
come out as they finish while new prompts take the freed slots.
"""

from .engine import Completion, Group, RolloutEngine, RolloutStats
from .kv import SlotCache, rollout_attention
from .prefix_cache import PrefixCache
from .shared import SharedPrefixCache, two_level_attention
from .params import SamplingParams
from .stream import PromptQueue
from .sampling import apply_top_k, apply_top_p, sample, sampling_distribution
from .stops import StopChecker

__all__ = [
    "RolloutEngine",
    "SamplingParams",
    "Completion",
    "Group",
    "RolloutStats",
    "PromptQueue",
    "SlotCache",
    "SharedPrefixCache",
    "PrefixCache",
    "two_level_attention",
    "StopChecker",
    "apply_top_k",
    "apply_top_p",
    "sample",
    "sampling_distribution",
    "rollout_attention",
]
