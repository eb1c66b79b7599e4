"""The running batch's one-token decode step with fixed shapes (per bucket of group slots
and own slots), whose inputs and output are views of the batch's persistent device
tensors: run eagerly, or on CUDA (``engine.cuda_graphs``) captured as a graph at its first
use and replayed after (:func:`~treerl.rollout.graphs.capture_graph`)."""

from __future__ import annotations

import torch

from .graphs import capture_graph


class DecodeStep:
    """Decode step over group slots ``[:hg]`` (rows ``[:hg x G]``) attending to ``own_len``
    own slots per row, ``pre_len`` prompt slots per group and every fork segment, writing
    the next-token logits into the batch's ``logits[:hi]``. ``batch``: a
    :class:`~treerl.rollout.stream.RunningBatch` (its ``last``, ``pos``, ``fill``,
    ``own_mask``, ``prefix_mask``, ``fork_node/fork_slot/fork_mask``, ``logits``; the
    cache's block table, read in the step: updated in place between steps)."""

    def __init__(self, engine, batch, hg: int, own_len: int, pre_len: int):
        hi = hg * batch.G
        self.engine, self.cache, self.own_len = engine, batch.cache, own_len
        self.ids = batch.last[:hi, None]
        self.pos = batch.pos[:hi, None]
        self.index = batch.fill[:hi]
        self.own_mask = batch.own_mask[:hi, None, None, :own_len]
        self.prefix_mask = batch.prefix_mask[:hg, None, None, :pre_len]
        self.fork_index = [(node[:hi], slot[:hi]) for node, slot in zip(batch.fork_node, batch.fork_slot)]
        self.fork_masks = [mask[: hg * c, None, None, :] for mask, (c, _, _) in zip(batch.fork_mask, batch.cache.forks)]
        self.out = batch.logits[:hi]
        self.batch = batch  # holds the graphs' memory pool
        self.use_graph = engine.cuda_graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        cache = self.cache
        # own_len from a shape (not a Python int attribute): compiled steps stay shape-generic
        cache.begin_step(self.index, self.own_mask.shape[-1], self.prefix_mask, self.fork_index, self.fork_masks)
        try:
            # into the batch's logits buffer (in the graph: the model's logits are a temporary of the shared pool, not
            # an output kept alive per graph); treerl's own blocks (Qwen2/Qwen3/Llama) write it in the head's product
            if self.engine.decode_blocks is not None:
                return self.engine.decode_blocks(self.ids, self.pos, cache, self.own_mask, self.prefix_mask, out=self.out)
            logits = self.engine.model(
                input_ids=self.ids, position_ids=self.pos, attention_mask=self.own_mask,
                past_key_values=cache, use_cache=True, rollout_prefix=cache,
            ).logits[:, -1]
            return self.out.copy_(logits)
        finally:
            cache.end_step()

    def __call__(self) -> torch.Tensor:
        if not self.use_graph:
            return self._forward()
        if self.graph is None:
            self.graph, self.logits = capture_graph(self.engine, self._forward, self.batch, "decode step")
            if self.graph is None:  # could not be captured: this engine decodes eagerly from now on
                self.use_graph = self.engine.cuda_graphs = False
                return self.logits
        self.graph.replay()
        return self.logits
