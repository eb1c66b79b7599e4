"""Data-parallel training helpers (DESIGN.md, "Distributed").

- :mod:`.features` -- what a tree costs, as numbers; :mod:`.cost_model` -- seconds from
  those numbers (fitted); :mod:`.partitioner` -- sequences to ranks for equal seconds.
- :mod:`.data_parallel` -- FSDP2 sharding and collectives; :mod:`.ranks` -- which rank does
  what in the synchronous trainer.
"""

from .cost_model import DEFAULT_COST_MODEL, ESTIMATED_COST_MODEL, FITTED_COST_MODEL, CostModel, default_cost_model, nnls
from .features import TreeFeatures, root_features, sequence_set_features, tree_features
from .partitioner import Assignment, Partition, Piece, assign, equal_token_partition, partition

__all__ = [
    "DEFAULT_COST_MODEL",
    "ESTIMATED_COST_MODEL",
    "FITTED_COST_MODEL",
    "Assignment",
    "CostModel",
    "Partition",
    "Piece",
    "TreeFeatures",
    "assign",
    "default_cost_model",
    "equal_token_partition",
    "nnls",
    "partition",
    "root_features",
    "sequence_set_features",
    "tree_features",
]
