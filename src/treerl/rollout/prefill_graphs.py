"""Small prefills in fixed shapes, replayed as CUDA graphs.

A serving batch admits a prompt or two every few decode steps, most of them a
conversation's next turn whose earlier turns come from the prefix cache: a prefill of a
few hundred new tokens, ~1 ms of GPU work on an H100 and ~50 ms of host time (56 calls
into compiled regions, each paying dynamo's guards and inductor's launcher, eager SDPA,
cuBLAS for a new shape: ``bench/profile_engine_thread.py``), while the decode steps of
every running row wait. Here such a prefill runs in a fixed layout, a
:class:`PrefillBucket`: its rows, query window and K/V slots rounded up to powers of two.
The padding is the prefill's usual padding (:class:`~treerl.rollout.prefill.Prefiller`):
padding rows and queries see, and write, slot 0 only, which no real query sees, so every
real token's attention is the one of the exact shape. The inputs are copied into the
bucket's static tensors and its forward is replayed as a CUDA graph captured at the
bucket's first use (``use_graphs``; without it, on the CPU for instance, the same layout
runs eagerly). A shape that a captured bucket holds with little padding runs there instead
of capturing its own (:meth:`PrefillGraphs.bucket`): a busy server captures few graphs.

Every bucket's cache is a view of one pair of K/V buffers (``max_slots`` rows x slots,
allocated at the first small prefill): a prefill's K/V is copied out, into the running
batch and the prefix cache, before the next prefill runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from .graphs import capture_graph
from .kv import SlotCache

MIN_WINDOW, MIN_SLOTS = 16, 256  # the smallest buckets (fewer shapes, hence fewer captures)
DEFAULT_TOKENS = 2048  # the rollout engine's default on CUDA (``prefill_graph_tokens``)
COVER_PADDING = 4  # a captured bucket runs a shape of up to this many times fewer query / K/V slots (bucket())


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << (max(int(n), 1) - 1).bit_length())


@dataclass(frozen=True)
class PrefillBucket:
    """A fixed prefill layout: ``rows`` sequences, ``window`` query slots (the last ones of
    each row), ``slots`` K/V slots per row."""

    rows: int
    window: int
    slots: int


class _BucketRun:
    """One bucket's static inputs, cache (views of the shared buffers) and CUDA graph."""

    def __init__(self, bucket: PrefillBucket, forward: Callable, keys: torch.Tensor, values: torch.Tensor,
                 num_layers: int, dtype: torch.dtype):
        R, W, C = bucket.rows, bucket.window, bucket.slots
        dev = keys.device
        self.cache = SlotCache(num_layers, C)
        self.cache.attach(keys, values)
        self.ids = torch.zeros(R, W, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(R, W, dtype=torch.int64, device=dev)
        self.index = torch.zeros(R, W, dtype=torch.int64, device=dev)
        self.mask = torch.zeros(R, 1, W, C, dtype=dtype, device=dev)
        self.model_forward, self.window = forward, W
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        """The forward on the static inputs: logits after each row's last query ``[R, V]``."""
        cache = self.cache
        cache.length = cache.capacity - self.window  # the window [C - W, C) is computed
        cache.write_index = self.index
        try:
            return self.model_forward(self.ids, self.pos, self.mask, cache)
        finally:
            cache.write_index = None


class PrefillGraphs:
    """Prefills of at most ``max_tokens`` (padded) query tokens and ``4 x max_tokens`` K/V
    slots, each in its :class:`PrefillBucket` (see the module docstring). ``forward``: a
    prefill forward ``(ids [R, W], pos [R, W], mask [R, 1, W, C], cache) -> logits [R, V]``
    (:class:`~treerl.rollout.prefill_blocks.PrefillForward`); ``kv_shape``: ``(kv heads,
    key dim, value dim)`` of the model's layers; ``engine``: the rollout engine (its device
    lock, held by a capture)."""

    def __init__(self, engine, forward: Callable, num_layers: int, kv_shape: tuple[int, int, int],
                 dtype: torch.dtype, device: torch.device, max_tokens: int, use_graphs: bool):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.engine, self.forward, self.num_layers = engine, forward, num_layers
        self.kv_shape, self.dtype, self.device = kv_shape, dtype, device
        self.max_tokens, self.max_slots = int(max_tokens), 4 * int(max_tokens)
        self.use_graphs = use_graphs
        self.graph_pool = None  # the graphs' shared memory pool (graphs.capture_graph)
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._runs: dict[PrefillBucket, _BucketRun] = {}
        self._where: tuple[int, ...] | None = None  # the model's tensors' addresses (see follow)

    def bucket(self, rows: int, window: int, slots: int) -> PrefillBucket | None:
        """The bucket of a prefill of ``rows`` sequences, ``window`` queries and ``slots`` K/V
        slots per row, or None when it is too large for one. A shape whose own bucket has no
        graph yet runs in the smallest captured bucket that holds it (at most ``COVER_PADDING``
        times its query slots and its K/V slots) instead of capturing one: a capture stalls
        every running row's decode for ~0.1-0.2 s (session 12 on an H200: the served short
        request's slowest probes), a padded replay costs ~1 ms."""
        b = PrefillBucket(_pow2(rows, 1), _pow2(window, MIN_WINDOW), _pow2(slots, MIN_SLOTS))
        if b.rows * b.window > self.max_tokens or b.rows * b.slots > self.max_slots:
            return None
        run = self._runs.get(b)
        if not self.use_graphs or (run is not None and run.graph is not None):
            return b
        covers = [c for c, r in self._runs.items() if r.graph is not None and c.rows >= b.rows and c.window >= b.window
                  and c.slots >= b.slots and c.rows * c.window <= COVER_PADDING * b.rows * b.window
                  and c.rows * c.slots <= COVER_PADDING * b.rows * b.slots]
        return min(covers, key=lambda c: (c.rows * c.window, c.rows * c.slots), default=b)

    def cache(self, bucket: PrefillBucket) -> SlotCache:
        """The bucket's cache (its K/V slots hold what the last prefill left: finite values)."""
        return self._run(bucket).cache

    def __call__(self, bucket: PrefillBucket, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                 write_index: torch.Tensor, stats=None) -> torch.Tensor:
        """Run the bucket's forward on these inputs (shaped as the bucket; the cache's
        prefix slots already loaded): its cache then holds the K/V (``length`` = the bucket's
        slots). Returns the logits after each row's last query ``[rows, V]``: the bucket's
        output tensor, rewritten by its next run. ``stats``: ``prefill_graph_builds`` counts
        the captures."""
        run = self._run(bucket)
        run.ids.copy_(ids)
        run.pos.copy_(pos)
        run.mask.copy_(mask)
        run.index.copy_(write_index)
        if self.use_graphs and run.graph is None:
            run.graph, run.logits = capture_graph(self.engine, run.forward, self, "prefill", warmups=2)
            if stats is not None:
                stats.prefill_graph_builds += 1
            if run.graph is None:  # could not be captured: eager from now on
                self.use_graphs = False
        if run.graph is not None:
            run.graph.replay()
            logits = run.logits
        else:
            logits = run.forward()
        run.cache.length = bucket.slots
        return logits

    def follow(self, model: torch.nn.Module) -> None:
        """Called at every stream's start: when a parameter or buffer of ``model`` is no longer
        where the captured graphs read it (moved off and back, loaded with ``assign=True``, a
        resized embedding; in-place updates keep their place), :meth:`release` them."""
        where = tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))
        if where != self._where:
            if self._where is not None:
                self.release()
            self._where = where

    def release(self) -> None:
        """Free the buckets' graphs, static tensors and K/V buffers (made again at the next
        small prefill; a new memory pool for the graphs)."""
        self._runs.clear()
        self._keys = self._values = None
        self.graph_pool = None

    def _run(self, bucket: PrefillBucket) -> _BucketRun:
        run = self._runs.get(bucket)
        if run is None:
            heads, key_dim, value_dim = self.kv_shape
            if self._keys is None:  # zeros: every slot finite (a masked key's weight is 0, and 0 x NaN is not)
                n = self.num_layers * heads * self.max_slots
                self._keys = torch.zeros(n * key_dim, dtype=self.dtype, device=self.device)
                self._values = torch.zeros(n * value_dim, dtype=self.dtype, device=self.device)
            shape = (self.num_layers, bucket.rows, heads, bucket.slots)
            n = self.num_layers * bucket.rows * heads * bucket.slots
            keys = self._keys[: n * key_dim].view(*shape, key_dim)
            values = self._values[: n * value_dim].view(*shape, value_dim)
            run = self._runs[bucket] = _BucketRun(bucket, self.forward, keys, values, self.num_layers, self.dtype)
        return run
