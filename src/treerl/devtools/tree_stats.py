"""Prefix-sharing statistics of rollouts: ``treerl tree-stats ROLLOUTS.jsonl``.

Each line is a JSON object with ``token_ids`` (and optionally ``step``); lines with the
same step form one training batch, merged into one prefix tree."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..engine.tree import PrefixTree


class RolloutsError(ValueError):
    pass


def load_batches(path: Path) -> dict[int, list[list[int]]]:
    if not path.is_file():
        raise FileNotFoundError(f"rollouts file not found: {path}")
    batches: dict[int, list[list[int]]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RolloutsError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or "token_ids" not in row:
            raise RolloutsError(f"{path}:{n}: expected an object with 'token_ids'")
        batches.setdefault(int(row.get("step", 0)), []).append(row["token_ids"])
    if not batches:
        raise RolloutsError(f"{path}: no rollouts in the file")
    return batches


def tree_histograms(tree: PrefixTree) -> tuple[Counter, Counter]:
    """(leaf depths in tokens, children per branching node)."""
    children = torch.bincount(tree.node_parent[tree.node_parent >= 0], minlength=tree.num_nodes)
    leaves = (children == 0).nonzero()[:, 0]
    depth = tree.position[tree.node_end[leaves] - 1] + 1
    return Counter(depth.tolist()), Counter(children[children > 0].tolist())


def _histogram(counter: Counter, bins: int = 8, width: int = 40) -> list[str]:
    if not counter:
        return ["  (none)"]
    values = sorted(counter.elements())
    lo, hi = values[0], values[-1]
    step = max(1, -(-(hi - lo + 1) // bins))
    edges = list(range(lo, hi + 1, step))
    counts = [sum(1 for v in values if e <= v < e + step) for e in edges]
    top = max(counts)
    return [f"  {e:>7}-{e + step - 1:<7} {'#' * max(1, round(width * c / top)) if c else '':<{width}} {c}"
            for e, c in zip(edges, counts)]


def main(path: Path, plot: Path | None = None) -> int:
    batches = load_batches(Path(path))
    flat = unique = seqs = 0
    depths, fans = Counter(), Counter()
    for step, sequences in sorted(batches.items()):
        tree = PrefixTree.from_sequences(sequences)
        flat += tree.num_flat_tokens
        unique += tree.num_tree_tokens
        seqs += tree.num_sequences
        d, f = tree_histograms(tree)
        depths += d
        fans += f
    print(f"{path}: {len(batches)} batches, {seqs} sequences")
    print(f"  flat tokens   {flat}")
    print(f"  unique tokens {unique}")
    print(f"  ideal ratio   {flat / unique:.3f}  (flat / unique: the speed-up if cost were linear in tokens)")
    print("leaf depth (tokens):")
    print("\n".join(_histogram(depths)))
    print("fan-out (children per branching node):")
    print("\n".join(_histogram(fans)))
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        axes[0].hist(list(depths.elements()), bins=20)
        axes[0].set_xlabel("leaf depth (tokens)")
        axes[1].hist(list(fans.elements()), bins=range(1, max(fans) + 2) if fans else 1)
        axes[1].set_xlabel("children per branching node")
        fig.suptitle(f"{Path(path).name}: ideal ratio {flat / unique:.2f}")
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")
    return 0
