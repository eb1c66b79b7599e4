"""The training engine: a batch of sequences merged into a :class:`PrefixTree`, planned into
segments (:mod:`.plan`) within a memory budget (:mod:`.memory`), and run through the
model's decoder (:mod:`.decoder`) with tree attention (:mod:`.attention`,
:mod:`.kept_attention`) and a chunked log-prob head (:mod:`.loss_head`) by
:class:`TreeEngine` (:mod:`.tree_engine`)."""

from .plan import Plan, Segment, TreeTooLargeError, make_plan
from .tree import PrefixTree, TokenSequence
from .tree_engine import StepStats, TreeEngine, TreeOutputs

__all__ = ["PrefixTree", "TokenSequence", "Plan", "Segment", "TreeTooLargeError", "make_plan",
           "TreeEngine", "TreeOutputs", "StepStats"]
