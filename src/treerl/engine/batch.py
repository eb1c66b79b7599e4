"""One engine call's input on the device, and the maps between tree tokens and the
per-sequence tensors a loss sees.

:func:`prepare_batch` lays a tree out for a plan (every index array in one host-to-device
copy); the other functions map sequences to the segments that hold them and to their
tokens 1..L-1 (the tokens a logprob predicts), all vectorised on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import Plan
from .tree import PrefixTree


@dataclass
class Batch:
    """A tree laid out for one mode, its plan, and its index tensors on the device."""

    tree: PrefixTree
    plan: Plan
    token_ids: torch.Tensor
    position: torch.Tensor
    parent: torch.Tensor
    subtree_end: torch.Tensor
    targets: list[torch.Tensor]  # per segment: the tree tokens it predicts
    seq_targets: torch.Tensor
    seq_lengths: list[int]  # L - 1 per sequence


def upload_indices(arrays: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D host index arrays on ``device`` in one copy, from pinned memory on CUDA: no host
    sync (a pageable copy synchronises the host with the stream)."""
    host = torch.cat(arrays)
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(a) for a in arrays]))


def prepare_batch(layout: PrefixTree, plan: Plan, device: torch.device) -> Batch:
    """``layout`` and ``plan`` as a :class:`Batch` on ``device``."""
    # All index arrays in one host-to-device copy without a host sync (treerl.overlap runs
    # forwards beside a rollout and must not wait for them).
    token_ids, position, parent, subtree_end, targets_of_seqs, *targets = upload_indices(
        [layout.token_ids, layout.position, layout.parent, layout.subtree_end, seq_targets(layout), *plan.targets],
        device)
    return Batch(tree=layout, plan=plan, token_ids=token_ids, position=position, parent=parent,
                 subtree_end=subtree_end, targets=list(targets), seq_targets=targets_of_seqs,
                 seq_lengths=(layout.seq_lengths - 1).tolist())


def seq_targets(tree: PrefixTree) -> torch.Tensor:
    """Tree tokens of positions 1..L-1 of every sequence, concatenated in input order."""
    keep = torch.ones(tree.num_flat_tokens, dtype=torch.bool)
    keep[tree.seq_offsets[:-1]] = False
    return tree.seq_index[keep]


def segment_of_sequences(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment starts [S] and, per sequence, the segment holding its first token [num_sequences] (CPU)."""
    starts = torch.tensor([s.start for s in b.plan.segments])
    tree = b.tree
    return starts, torch.searchsorted(starts, tree.seq_index[tree.seq_offsets[:-1]], right=True) - 1


def flat_positions(lengths: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
    """Positions in the concatenated per-sequence tensors (tokens 1..L-1, ``lengths`` = L-1
    each) of the sequences ``seqs``, in that order (CPU, vectorised)."""
    sizes = lengths[seqs]
    within = torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return torch.repeat_interleave((torch.cumsum(lengths, 0) - lengths)[seqs], sizes) + within


def sequences_by_segment(b: Batch, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Single-level plans: per segment, its sequences (input indices, CPU), the
    segment-local tree positions of their tokens 1..L-1 (``device``) and their lengths."""
    starts, seg_of_seq = segment_of_sequences(b)
    lengths = torch.tensor(b.seq_lengths)
    # Sequences grouped by segment (stable: input order within a segment); the flat
    # positions of their tokens 1..L-1 gathered in one vectorised step.
    order = torch.argsort(seg_of_seq, stable=True)
    sizes = lengths[order]
    flat_pos = flat_positions(lengths, order)
    local = seq_targets(b.tree)[flat_pos] - torch.repeat_interleave(starts[seg_of_seq[order]], sizes)
    local = local.to(device).split(
        torch.bincount(seg_of_seq, weights=lengths.double(), minlength=len(starts)).long().tolist())
    counts = torch.bincount(seg_of_seq, minlength=len(starts)).tolist()
    groups = order.split(counts)
    return [(g, idx, lengths[g].tolist()) for g, idx in zip(groups, local)]


def sequences_ending_in(b: Batch, segments: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Per segment of ``segments`` that holds the last token of some sequences: those
    sequences (input indices, CPU), their tree tokens 1..L-1 (device) and lengths L-1. Every
    other token of such a sequence lies in the segment's ancestors."""
    starts = torch.tensor([s.start for s in b.plan.segments])
    tree = b.tree
    ends = torch.searchsorted(starts, tree.seq_index[tree.seq_offsets[1:] - 1], right=True) - 1
    lengths = torch.tensor(b.seq_lengths, dtype=torch.long)
    groups = {i: seqs for i in sorted(segments) if len(seqs := (ends == i).nonzero()[:, 0])}
    if not groups:
        return {}
    # every group's positions in one upload without a host sync (not one pageable copy per segment)
    flat = upload_indices([flat_positions(lengths, seqs) for seqs in groups.values()], b.seq_targets.device)
    return {i: (seqs, b.seq_targets[pos], lengths[seqs].tolist()) for (i, seqs), pos in zip(groups.items(), flat)}


def scatter_gather(values: torch.Tensor, local_index: torch.Tensor, size: int, flat_index: torch.Tensor,
                   sizes: list[int]) -> list[torch.Tensor]:
    """A segment's ``values`` at its targets' ``local_index`` -> per-sequence tensors (the
    segment-local positions ``flat_index`` of their tokens, split by ``sizes``)."""
    local = values.new_zeros(size).index_copy(0, local_index, values)
    return list(local[flat_index].split(sizes))


def outputs_and_grads(b: Batch, i: int, lp: torch.Tensor, ent: torch.Tensor | None, g_lp: torch.Tensor,
                      g_ent: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A call's outputs (segment ``i``'s logprobs, and entropies when ``g_ent`` is given) and
    their incoming gradients, taken from the whole batch's ``g_lp`` / ``g_ent``, for
    ``torch.autograd.backward``."""
    outs, grads = [lp], [g_lp[b.targets[i]]]
    if g_ent is not None:
        outs.append(ent)
        grads.append(g_ent[b.targets[i]])
    return outs, grads
