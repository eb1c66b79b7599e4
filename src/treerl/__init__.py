"""treerl: RL post-training of LLMs over prefix trees, every shared token computed once."""

from .engine import StepStats, TreeEngine, TreeOutputs
from .plan import Plan, Segment, TreeTooLargeError, make_plan
from .tree import PrefixTree

__all__ = ["PrefixTree", "TreeEngine", "TreeOutputs", "StepStats", "Plan", "Segment", "TreeTooLargeError", "make_plan"]
__version__ = "0.1.0"
