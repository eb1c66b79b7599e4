"""treerl: RL post-training of LLMs over prefix trees, every shared token computed once."""

from .engine import Plan, PrefixTree, Segment, StepStats, TreeEngine, TreeOutputs, TreeTooLargeError, make_plan

__all__ = ["PrefixTree", "TreeEngine", "TreeOutputs", "StepStats", "Plan", "Segment", "TreeTooLargeError", "make_plan"]
__version__ = "0.1.0"
