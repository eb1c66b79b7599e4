"""One layer's attention run once although its decoder block is recomputed.

Block recompute (activation checkpointing, :mod:`treerl.engine.decoder`) runs each block's
forward again in the backward, attention included. For a layer the engine marks
(:attr:`treerl.engine.attention.TreeAttention.keep_layers`) the attention runs once:

- **forward**: the attention's autograd node saves its tensors through :meth:`KeptAttention.pack`
  instead of the checkpoint: its output, log-sum-exp and mask are held as they are, but
  the tensors on the storage of its inputs (query, key, value) are not: each is replaced
  by a note of its view.
- **the block's recompute** in the backward produces query, key and value again, bit for
  bit (the recompute runs before the attention's backward, because the rest of the
  block's backward needs it first). The attention does not run again: it returns the held
  output and leaves the recomputed inputs to :meth:`KeptAttention.unpack`, which hands the
  attention's backward its saved views on them.

A kept layer holds its attention output and log-sum-exp (~4 kB per query for 16 heads of
128 in bf16; a whole block holds ~77 kB) and skips the attention forward of the recompute.
"""

from __future__ import annotations

from typing import Callable

import torch

_View = tuple[int, torch.Size, tuple[int, ...], int]  # input index, shape, stride, storage offset


class KeptAttention:
    """The held state of one layer's attention in one model call.

    Args:
        inputs: the tensors the attention kernel reads (query, key, value, as it gets
            them): saved tensors on their storage are not held but taken from the
            recompute.
    """

    def __init__(self, inputs: tuple[torch.Tensor, ...]):
        self._inputs = {}  # storage address -> (input index, dtype)
        for i, x in enumerate(inputs):
            self._inputs.setdefault(x.untyped_storage().data_ptr(), (i, x.dtype))
        self._layout = [_layout(x) for x in inputs]
        self.output: torch.Tensor | None = None
        self.views_saved = 0  # saved tensors taken from the recompute (not held)
        self._recomputed: tuple[torch.Tensor, ...] | None = None
        self._views_left = 0

    def run(self, attend: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """The forward: ``attend(*inputs)``, its saved tensors packed by this object."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            self.output = attend(*inputs)
        return self.output

    def recompute(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The block's recompute: keep its ``inputs`` (same order as the forward's) for the
        attention's backward and return the forward's output (detached)."""
        if self.output is None:
            raise RuntimeError("a kept attention was recomputed twice (backward through the same call twice?)")
        if [_layout(x) for x in inputs] != self._layout:
            raise RuntimeError("the recompute laid out the attention's inputs differently from the forward")
        self._recomputed = inputs
        self._views_left = self.views_saved
        output, self.output = self.output, None
        return output.detach()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _View:
        source = self._inputs.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if source is None or source[1] != tensor.dtype:
            return tensor
        self.views_saved += 1
        return (source[0], tensor.shape, tensor.stride(), tensor.storage_offset())

    def unpack(self, saved: torch.Tensor | _View) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if self._recomputed is None:
            raise RuntimeError("the attention's backward ran before its block's recompute: a kept attention "
                               "needs its decoder block checkpointed (treerl.engine.decoder)")
        index, shape, stride, offset = saved
        view = self._recomputed[index].as_strided(shape, stride, offset)
        self._views_left -= 1
        if self._views_left == 0:
            self._recomputed = None
        return view


def _layout(x: torch.Tensor) -> tuple:
    return x.shape, x.stride(), x.storage_offset(), x.dtype
