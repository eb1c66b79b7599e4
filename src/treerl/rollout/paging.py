"""Block allocation of the rows' own K/V: the host side of the paged row store.

The rows of a running batch keep the tokens they generate (their *own* slots, see
:mod:`~treerl.rollout.shared`) in a pool of ``num_blocks`` blocks of ``block_size`` slots
per layer, ``[num_blocks + 1, kv_heads, block_size, head_dim]``. Row ``r``'s own slot ``j``
is slot ``j % block_size`` of block ``table[r, j // block_size]``. A row owns only the
blocks its writes have reached; the entries past them name the *trash* block (index
``num_blocks``, never handed out): rows that are not live, or not yet at their own tokens,
write their step's K/V there (and what is read from it is masked), so a fixed-shape decode
step never writes into a block another row owns.

:class:`BlockTable` keeps the table on the host (numpy) with the free list; the batch
copies it into its device table (in place: captured CUDA graphs keep their pointers)
when it changed (:meth:`BlockTable.upload`), before the next decode step or K/V load.
"""

from __future__ import annotations

import numpy as np
import torch


def block_size_for(own_capacity: int, block_size: int) -> int:
    """Slots per block: ``block_size``, or the whole own capacity when that is smaller
    (a row of few own slots takes one block that fits it)."""
    return min(block_size, own_capacity)


class BlockTable:
    """Which pool block holds each row's own slots, and the free blocks.

    ``rows`` rows of at most ``max_blocks`` blocks each; ``num_blocks`` blocks of
    ``block_size`` slots in the pool (block ``num_blocks`` is the trash block).
    ``table [rows, max_blocks]`` (int64; the trash block past each row's ``owned``
    blocks), ``owned [rows]``; ``dirty``: changed since the last :meth:`upload`."""

    def __init__(self, rows: int, max_blocks: int, num_blocks: int, block_size: int):
        self.rows, self.max_blocks, self.num_blocks, self.block_size = rows, max_blocks, num_blocks, block_size
        self.table = np.full((rows, max_blocks), num_blocks, dtype=np.int64)
        self.owned = np.zeros(rows, dtype=np.int64)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest block first
        self.dirty = True

    @property
    def trash(self) -> int:
        return self.num_blocks

    @property
    def free(self) -> int:
        """Blocks not owned by any row."""
        return len(self._free)

    def blocks_for(self, slots: np.ndarray) -> np.ndarray:
        """Blocks that cover ``slots`` own slots (per row; at most ``max_blocks``)."""
        return np.clip(-(-np.asarray(slots, dtype=np.int64) // self.block_size), 0, self.max_blocks)

    def missing(self, rows: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Blocks each of ``rows`` lacks to cover its first ``slots`` own slots."""
        return np.maximum(self.blocks_for(slots) - self.owned[rows], 0)

    def grow(self, rows: np.ndarray, slots: np.ndarray) -> bool:
        """Give ``rows`` the blocks that cover their first ``slots`` own slots, all or
        nothing: False (and nothing changed) if too few blocks are free."""
        rows = np.asarray(rows, dtype=np.int64)
        want = self.missing(rows, slots)
        if want.sum() > len(self._free):
            return False
        for r, n in zip(rows[want > 0], want[want > 0]):
            o = self.owned[r]
            self.table[r, o : o + n] = [self._free.pop() for _ in range(n)]
            self.owned[r] = o + n
            self.dirty = True
        return True

    def release(self, rows: np.ndarray) -> None:
        """Return the blocks of ``rows`` to the free list (their entries: the trash block)."""
        for r in np.asarray(rows, dtype=np.int64).reshape(-1):
            n = self.owned[r]
            if n:
                self._free.extend(self.table[r, :n][::-1].tolist())
                self.table[r, :n] = self.trash
                self.owned[r] = 0
                self.dirty = True

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Rows ``src`` hand their blocks to rows ``dst`` (which own none); ``src`` then own
        none. (The caller moves the device table the same way: no upload needed.)"""
        self.table[dst], self.owned[dst] = self.table[src], self.owned[src]
        self.table[src], self.owned[src] = self.trash, 0

    def upload(self, device_table: torch.Tensor) -> None:
        """Copy the table into ``device_table [rows, max_blocks]`` in place, if it changed."""
        if not self.dirty:
            return
        src = torch.from_numpy(self.table)
        if device_table.device.type == "cuda":
            # pinned and asynchronous: no host sync (the pinned buffer lives until the copy ran)
            device_table.copy_(src.pin_memory(), non_blocking=True)
        else:
            device_table.copy_(src)
        self.dirty = False

    def check(self) -> None:
        """Every block is free or owned by exactly one row (tests)."""
        owned = np.concatenate([self.table[r, : self.owned[r]] for r in range(self.rows)] + [np.zeros(0, np.int64)])
        assert len(set(owned.tolist())) == len(owned), "a block owned twice"
        assert not set(owned.tolist()) & set(self._free), "a block both owned and free"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks lost"
        assert (self.table[np.arange(self.max_blocks)[None, :] >= self.owned[:, None]] == self.trash).all()
