"""Data-parallel training helpers (DESIGN.md, "Distributed")."""

from .balance import (
    DEFAULT_COST_MODEL,
    ESTIMATED_COST_MODEL,
    FITTED_COST_MODEL,
    Assignment,
    CostModel,
    Partition,
    Piece,
    TreeFeatures,
    assign,
    default_cost_model,
    equal_token_partition,
    nnls,
    partition,
    root_features,
    sequence_set_features,
    tree_features,
)

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
