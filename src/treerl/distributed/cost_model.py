"""The cost model: predicted seconds of one ``TreeEngine.forward_backward`` call from a
tree's :class:`~treerl.distributed.features.TreeFeatures`,

    per_call + per_token * tokens + per_pair * attention_pairs + per_node * nodes + per_leaf * leaves,

fitted by non-negative least squares (``scipy.optimize.nnls``) to measured step times
(``bench/bench_balance.py --fit``). Shipped: :data:`ESTIMATED_COST_MODEL` (from FLOPs,
Qwen3-1.7B bf16) and :data:`DEFAULT_COST_MODEL` = :data:`FITTED_COST_MODEL` (the same
shape fitted on an H200; valid for that setting only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .features import TreeFeatures

__all__ = ["CostModel", "DEFAULT_COST_MODEL", "ESTIMATED_COST_MODEL", "FITTED_COST_MODEL", "default_cost_model", "nnls"]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares: ``argmin_x ||a @ x - b||_2`` with ``x >= 0``
    (``scipy.optimize.nnls``; columns are scaled to unit norm first, as features differ by
    ~10 orders of magnitude)."""
    from scipy.optimize import nnls as scipy_nnls  # only fitting needs scipy (offline, not in training)

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls: need a [m, n] matrix and an [m] vector, got {a.shape} and {b.shape}")
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return np.maximum(scipy_nnls(a / scale, b)[0], 0.0) / scale


@dataclass(frozen=True)
class CostModel:
    """Seconds of one ``TreeEngine.forward_backward`` call over a tree with given features:

    ``per_call + per_token * tokens + per_pair * attention_pairs + per_node * nodes
    + per_leaf * leaves`` (0 for an empty tree). All coefficients are seconds per unit and
    non-negative. Linear, so a rank's cost is ``per_call`` plus the sum of its pieces'
    :meth:`marginal` costs (the partitioner's additive weights).
    """

    per_token: float = 0.0  # s per unique tree token
    per_pair: float = 0.0  # s per attention query-key pair
    per_node: float = 0.0  # s per node
    per_leaf: float = 0.0  # s per leaf node
    per_call: float = 0.0  # s per forward_backward call (fixed overhead)
    name: str = ""
    source: str = "estimate"  # "estimate" or a description of the measurements it was fitted to
    fit_stats: dict = field(default_factory=dict, compare=False)

    COLUMNS = ("tokens", "attention_pairs", "nodes", "leaves", "calls")

    @property
    def coefficients(self) -> np.ndarray:
        """[per_token, per_pair, per_node, per_leaf, per_call]."""
        return np.array([self.per_token, self.per_pair, self.per_node, self.per_leaf, self.per_call])

    def marginal(self, features: TreeFeatures) -> float:
        """Seconds the features add to a call (everything but ``per_call``)."""
        return float(self.coefficients[:4] @ features.vector())

    def predict(self, features: TreeFeatures) -> float:
        """Predicted seconds of one forward_backward over a tree with ``features``."""
        return 0.0 if features.tokens == 0 else self.per_call + self.marginal(features)

    def predict_many(self, features: Sequence[TreeFeatures]) -> np.ndarray:
        return np.array([self.predict(f) for f in features])

    @staticmethod
    def design_matrix(features: Sequence[TreeFeatures]) -> np.ndarray:
        """[len(features), 5]: tokens, pairs, nodes, leaves, 1 (one call each)."""
        return np.array([[*f.vector(), 1.0] for f in features], dtype=np.float64).reshape(-1, 5)

    @staticmethod
    def fit(
        features: Sequence[TreeFeatures],
        seconds: Sequence[float],
        *,
        relative: bool = True,
        name: str = "",
        source: str = "fitted",
    ) -> "CostModel":
        """Fit all five coefficients (>= 0) to measured seconds of one call per tree.

        ``relative=True`` minimises squared *relative* errors (rows divided by the measured
        time), so small and large trees weigh alike; else absolute seconds.
        """
        x_mat = CostModel.design_matrix(features)
        y = np.asarray(seconds, dtype=np.float64)
        if len(y) != len(x_mat) or len(y) == 0:
            raise ValueError(f"fit: {len(x_mat)} feature rows and {len(y)} timings")
        if np.any(y <= 0) or not np.all(np.isfinite(y)):
            raise ValueError("fit: timings must be positive, finite seconds")
        w = 1.0 / y if relative else np.ones_like(y)
        coef = nnls(x_mat * w[:, None], y * w).tolist()
        stats = CostModel(*coef).quality(features, y)
        return CostModel(*coef, name=name, source=source, fit_stats=stats)

    def quality(self, features: Sequence[TreeFeatures], seconds: Sequence[float]) -> dict:
        """R^2, max and mean relative error of the predictions against measured seconds."""
        y = np.asarray(seconds, dtype=np.float64)
        pred = self.predict_many(features)
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        rel = np.abs(pred - y) / y
        return {
            "n": int(len(y)),
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            "max_rel_err": float(rel.max()),
            "mean_rel_err": float(rel.mean()),
        }

    @staticmethod
    def from_flops(
        params: float,
        layers: int,
        heads: int,
        head_dim: int,
        *,
        achieved_tflops: float = 275.0,
        per_call_s: float = 0.12,
        name: str = "",
    ) -> "CostModel":
        """An *estimate* from FLOPs: forward+backward matmuls ``6 * params`` per token and
        attention ``12 * layers * heads * head_dim`` per query-key pair, at
        ``achieved_tflops``; ``per_call_s`` of fixed overhead per call; nodes and leaves
        free. Replace by a fit (``bench/bench_balance.py --fit``) on the target GPU."""
        rate = achieved_tflops * 1e12
        return CostModel(
            per_token=6.0 * params / rate,
            per_pair=12.0 * layers * heads * head_dim / rate,
            per_call=per_call_s,
            name=name,
            source=f"estimate: {achieved_tflops:g} TFLOP/s on 6*params*tokens + attention FLOPs, "
            f"{per_call_s:g} s per call; not fitted",
        )

    # ------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        known = {f for f in CostModel.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown cost model fields {sorted(unknown)}")
        return CostModel(**data)

    def describe(self) -> str:
        return (
            f"CostModel({self.name or 'unnamed'}: {self.per_call * 1e3:.1f} ms/call + "
            f"{self.per_token * 1e6:.2f} us/token + {self.per_pair * 1e9:.3f} ns/pair + "
            f"{self.per_node * 1e6:.1f} us/node + {self.per_leaf * 1e6:.1f} us/leaf; {self.source})"
        )


# An ESTIMATE, not a measurement: Qwen3-1.7B shape (28 layers, 16 heads of 128), bf16 on
# one H100/H200, at the ~275 TFLOP/s that the packed tree engine reached on unique tokens
# (bench/RESULTS.md) and ~0.12 s per forward_backward call of fixed overhead.
ESTIMATED_COST_MODEL = CostModel.from_flops(
    1.7e9, layers=28, heads=16, head_dim=128, achieved_tflops=275.0, per_call_s=0.12,
    name="qwen3-1.7b bf16 H100/H200 (FLOP estimate)",
)

# FITTED on one NVIDIA H200 (2026-11-22, torch 2.11.0+cu130, code of commit 4fe9cd3 plus
# this module): ``bench/bench_balance.py --fit --device cuda`` with the Qwen3-1.7B shape,
# bf16, TreeEngine mode "auto", max_tokens 16384; the 78 measured random batches of
# 2,048-32,768 unique tokens (of 132; smaller ones are launch-bound, and rank shares are
# larger). Held-out (every 4th): R^2 0.971, max relative error 0.137, mean 0.049. Checked
# on 116 independently measured rank shares of the grpo/agentic/mixed workloads split over
# 2-8 ranks (``--measure``): R^2 0.994, mean relative error 0.033 (max 0.35, one share).
# Only valid for that shape, dtype, engine mode and budget: refit for anything else.
FITTED_COST_MODEL = CostModel(
    per_token=3.2009e-05,
    per_pair=3.7189e-09,
    per_node=0.0,
    per_leaf=1.5510e-04,
    per_call=4.9404e-02,
    name="qwen3-1.7b bf16 H200 auto/16384 (fitted)",
    source="fitted: bench/bench_balance.py --fit on NVIDIA H200, qwen3-1.7b bfloat16, TreeEngine auto "
    "max_tokens 16384, 78 batches of 2048-32768 tokens, 2026-11-22; held-out R^2 0.971",
)

# The default: the H200 fit. For another GPU, model shape or engine setting, fit one with
# bench/bench_balance.py --fit and pass it (or its JSON through default_cost_model(path)).
DEFAULT_COST_MODEL = FITTED_COST_MODEL


def default_cost_model(path: str | Path | None = None) -> CostModel:
    """The cost model in ``path`` (JSON written by :meth:`CostModel.save`), else the
    shipped :data:`DEFAULT_COST_MODEL` (:data:`FITTED_COST_MODEL`)."""
    return CostModel.load(path) if path is not None else DEFAULT_COST_MODEL
