"""The running batch's device side: its buffers, the K/V cache, loading prefilled K/V,
moving groups, the decode step and sampling.

:class:`DeviceBatch` holds every device tensor of a running batch (rows ``S = groups x G``):
the :class:`~treerl.rollout.shared.SharedPrefixCache` (allocated at the first load, shapes
from the prefill), additive masks (prompt, own slots, fork segments), each row's next own
slot (``fill``), completion tokens fed (``fed``), next position (``pos``), live flag
(``live_d``), last sampled token (``last``), pending logits, the block table (updated in
place from the host's :class:`~treerl.rollout.paging.BlockTable`) and the log of sampled
tokens and logprobs between host syncs. It decides nothing: the host
(:class:`~treerl.rollout.scheduler.Scheduler`) says which rows and slots.
"""

from __future__ import annotations

import numpy as np
import torch

from .paging import BlockTable
from .sampling import sample, sample_rows, widened
from .log_reads import LogRead
from .scheduler import RowSampling
from .shared import SharedPrefixCache
from .step import DecodeStep
from .forks import ForkLayout
from .types import RolloutStats, to_device


TOP_LOGPROBS = 20  # top tokens logged per sampled token when a group asks (SamplingParams.top_logprobs <= 20)


def _t(a, device) -> torch.Tensor:
    return to_device(np.asarray(a, dtype=np.int64), device)


class DeviceBatch:
    """Device state of a running batch of group slots of ``tree.rows`` rows; ``block`` own
    slots per block, ``max_blocks`` per row. ``engine``: the
    :class:`~treerl.rollout.RolloutEngine` (its model, device, dtypes, ``sync_every``,
    decode forward and CUDA-graph settings)."""

    # the buffers kept for the engine's next stream of the same shapes
    STATE = ("cache", "prefix_mask", "own_mask", "table", "fill", "fed", "pos", "live_d", "last", "logits",
             "log_tok", "log_lp", "fork_mask", "fork_node", "fork_slot", "steps_cache", "graph_pool")

    def __init__(self, engine, tree: ForkLayout, block: int, max_blocks: int, stats: RolloutStats,
                 own_prompts: bool = False):
        self.e, self.tree, self.G, self.block, self.max_blocks = engine, tree, tree.rows, block, max_blocks
        self.own_prompts = own_prompts  # prompts in the rows' own blocks (the prompt store unused)
        self.N = max_blocks * block
        self.stats = stats
        self.device = engine.device
        self.dtype = next(engine.model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min
        self.zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self.hide = torch.full((), self.neg, dtype=self.dtype, device=self.device)
        self._settings_key: tuple | None = None  # the rows' sampling settings last uploaded (_row_settings)
        self._settings: tuple[torch.Tensor, ...] = ()

    def arena_key(self, groups: int, prefix_capacity: int, num_blocks: int) -> tuple:
        e = self.e
        return (groups, self.tree, prefix_capacity, num_blocks, self.block, e.sync_every, self.dtype, e.logit_dtype,
                e.pending_logit_dtype, e.vocab_size)

    def arena(self) -> tuple:
        """``(shapes, buffers)``: the device state (buffers, cache, captured decode steps) for
        reuse by a stream of the same shapes (``RolloutEngine(keep_stream_buffers=True)``)."""
        return self.arena_key(self.NG, self.P, self.num_blocks), {k: getattr(self, k) for k in self.STATE}

    def allocate(self, groups: int, prefix_capacity: int, num_blocks: int, kept: tuple | None = None) -> None:
        """(Re)build the buffers for ``groups`` group slots of ``prefix_capacity`` prompt slots
        and a pool of ``num_blocks`` blocks (nothing may be live). ``kept``: an earlier
        stream's :meth:`arena`, reused (reset) if its shapes match."""
        e, dev, G, tree = self.e, self.device, self.G, self.tree
        S = groups * G
        self.NG, self.S, self.P, self.num_blocks = groups, S, prefix_capacity, num_blocks
        self.log_topi = self.log_topv = None  # top tokens' log, allocated when a group asks
        if kept is not None and kept[0] == self.arena_key(groups, prefix_capacity, num_blocks):
            for k, v in kept[1].items():
                setattr(self, k, v)
            for mask in [self.prefix_mask, self.own_mask] + self.fork_mask:
                mask.fill_(self.neg)
            for t in (self.fill, self.fed, self.pos, self.live_d, self.last):
                t.zero_()
            self.table.fill_(num_blocks)
            return
        del kept
        self.cache = None  # SharedPrefixCache, allocated at the first load (shapes from the prefill)
        self.steps_cache: dict[tuple[int, int], DecodeStep] = {}
        self.graph_pool = None  # the CUDA graphs' memory pool (graphs.capture_graph)
        self.prefix_mask = torch.full((groups, prefix_capacity), self.neg, dtype=self.dtype, device=dev)
        self.own_mask = torch.full((S, self.N), self.neg, dtype=self.dtype, device=dev)
        # each row's own blocks (the trash block past them); updated in place from the host table
        self.table = torch.full((S, self.max_blocks), num_blocks, dtype=torch.int64, device=dev)
        self.fill = torch.zeros(S, dtype=torch.int64, device=dev)  # next own slot of each row
        # completion tokens fed (K/V written) per row; plain groups: the own slot, one tensor
        self.fed = torch.zeros(S, dtype=torch.int64, device=dev) if tree.depth else self.fill
        self.pos = torch.zeros(S, dtype=torch.int64, device=dev)  # next position id
        self.live_d = torch.zeros(S, dtype=torch.int64, device=dev)
        self.last = torch.zeros(S, dtype=torch.int64, device=dev)  # last sampled token (fed next)
        self.logits = torch.zeros(S, e.vocab_size, dtype=e.pending_logit_dtype, device=dev)
        K = e.sync_every + 2  # a sync window logs <= sync_every + 1 sample calls
        self.log_tok = torch.zeros(K, S, dtype=torch.int64, device=dev)
        self.log_lp = torch.zeros(K, S, dtype=e.logit_dtype, device=dev)
        # fork levels: segment masks [groups x c_k, cap_k]; each row's node and write slot per level
        self.fork_mask = [torch.full((groups * tree.nodes(k), tree.segment_capacity(k)), self.neg,
                                     dtype=self.dtype, device=dev) for k in range(tree.depth)]
        self.fork_node = [torch.arange(S, device=dev) // tree.rows_per_node(k) for k in range(tree.depth)]
        self.fork_slot = [torch.zeros(S, dtype=torch.int64, device=dev) for _ in range(tree.depth)]

    def set_live(self, live: np.ndarray) -> None:
        # (rows that stop decoding keep their masks, so the kernels still read their K/V: hiding them was measured
        # in session 18 and bought nothing, served or in a GRPO tail: a step's attention waits for its longest row)
        self.live_d.copy_(to_device(live.astype(np.int64), self.device))

    # ------------------------------------------------------------------ loading
    def load(self, prefilled, slots: np.ndarray, seq_lens: list[int], group_src: list[int], row_src: list[int],
             plen: list[int], blocks: BlockTable) -> tuple[torch.Tensor, np.ndarray]:
        """Load group slots ``slots`` from ``prefilled`` (``(cache, lengths, logits)`` of
        sequences of lengths ``seq_lens``, each a prompt followed by tokens a row fed): slot
        ``slots[i]`` gets the prompt (the first ``plen[i]`` tokens) of sequence
        ``group_src[i]``; the ``j``-th row of the slots (``len(slots) x G`` in order)
        continues sequence ``row_src[j]`` (-1: a row not live, nothing of its own); each fork
        segment gets its tokens from the first live row below it; own tokens go into the
        blocks ``blocks`` gives the rows (uploaded first). Sets stores, masks and the rows'
        ``fed``/``pos``/``fill``. Returns the logits after each slot's group sequence
        ``[len(slots), V]`` and the rows' tokens fed ``[len(slots) x G]``."""
        e, dev, G, tree = self.e, self.device, self.G, self.tree
        tmp, _, logits = prefilled
        if self.cache is None:
            k, v = tmp.layers[0].keys, tmp.layers[0].values
            forks = [(tree.nodes(j), tree.segment_capacity(j), tree.rows_per_node(j)) for j in range(tree.depth)]
            self.cache = SharedPrefixCache(e.num_layers, self.NG, G, self.P, self.table, self.num_blocks,
                                           self.block, k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device, forks,
                                           prompts_in_own_blocks=self.own_prompts, kv_dtype=e.kv_dtype)
        t = lambda a: _t(a, dev)  # noqa: E731
        lens = np.asarray(seq_lens)
        pad = tmp.length - lens  # slot of each sequence's first token
        plen_a = np.asarray(plen, dtype=np.int64)
        assert not self.own_prompts or not plen_a.any(), "prompts in own blocks leave the prompt store empty"
        rows = (slots[:, None] * G + np.arange(G)).reshape(-1)
        src = np.asarray(row_src, dtype=np.int64)
        row_plen = np.repeat(plen_a, G)
        fed = np.where(src >= 0, lens[np.maximum(src, 0)] - row_plen, 0)
        # the prompts
        gsrc = np.asarray(group_src)
        self.cache.load(tmp, "prefix", t(slots), t(gsrc), t(pad[gsrc]), int(plen_a.max()))
        slot = torch.arange(self.P, device=dev)
        self.prefix_mask[t(slots)] = torch.where(slot[None, :] < t(plen_a)[:, None], self.zero, self.hide)
        # fork segments: node j of level k (slot i) from the first live row below it
        for k in range(tree.depth):
            c, r, t0, t1 = tree.nodes(k), tree.rows_per_node(k), tree.start(k), tree.end(k)
            nodes = (slots[:, None] * c + np.arange(c)).reshape(-1)
            filled = np.zeros(len(nodes), dtype=np.int64)
            copy = []  # (node index into nodes, row index into rows)
            for n in range(len(nodes)):
                below = np.flatnonzero(src[n * r : (n + 1) * r] >= 0)
                if len(below):
                    j = n * r + below[0]
                    filled[n] = min(max(fed[j] - t0, 0), t1 - t0)
                    if filled[n]:
                        copy.append((n, j))
            if copy:
                ni, ri = np.asarray(copy).T
                self.cache.load(tmp, k, t(nodes[ni]), t(src[ri]), t(pad[src[ri]] + row_plen[ri] + t0),
                                int(filled[ni].max()))
            slot = torch.arange(tree.segment_capacity(k), device=dev)
            self.fork_mask[k][t(nodes)] = torch.where(slot[None, :] < t(filled)[:, None], self.zero, self.hide)
        # each row's own tokens, into its blocks
        own = np.maximum(fed - tree.own_start, 0)
        mine = np.flatnonzero(own > 0)
        assert (blocks.missing(rows, own) == 0).all(), "rows load own K/V into blocks they do not own"
        blocks.upload(self.table)
        if len(mine):
            self.cache.load(tmp, "own", t(rows[mine]), t(src[mine]),
                            t(pad[src[mine]] + row_plen[mine] + tree.own_start), int(own.max()))
        slot = torch.arange(self.N, device=dev)
        rows_t = t(rows)
        self.own_mask[rows_t] = torch.where(slot[None, :] < t(own)[:, None], self.zero, self.hide)
        self.fill[rows_t] = t(own)
        self.fed[rows_t] = t(fed)
        self.pos[rows_t] = t(row_plen + fed)
        return logits[t(gsrc)], fed

    def set_logits(self, rows: np.ndarray, logits: torch.Tensor) -> None:
        self.logits[_t(rows, self.device)] = logits.to(self.logits.dtype)  # (the prefill's: in this dtype already)

    def set_last(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        self.last[_t(rows, self.device)] = _t(tokens, self.device)

    def grow_prefix(self, capacity: int) -> None:
        """More prompt slots per group (captured decode steps are dropped)."""
        extra = torch.full((self.NG, capacity - self.P), self.neg, dtype=self.dtype, device=self.device)
        self.prefix_mask = torch.cat([self.prefix_mask, extra], dim=1)
        if self.cache is not None:
            self.cache.grow_prefix(capacity)
        self.P = capacity
        self.steps_cache.clear()
        self.graph_pool = None  # its graphs are gone, and with them the pool

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move group slots ``src`` to ``dst`` (prefix, segments, block table rows, masks and
        per-row buffers; own K/V stays in its blocks)."""
        dev, G = self.device, self.G
        s_t, d_t = _t(src, dev), _t(dst, dev)
        self.cache.move_groups(d_t, s_t)  # (and the device block table's rows)
        self.prefix_mask[d_t] = self.prefix_mask[s_t]
        for k, mask in enumerate(self.fork_mask):
            c = self.tree.nodes(k)
            mask[_t((dst[:, None] * c + np.arange(c)).reshape(-1), dev)] = \
                mask[_t((src[:, None] * c + np.arange(c)).reshape(-1), dev)]
        rs_t = _t((src[:, None] * G + np.arange(G)).reshape(-1), dev)
        rd_t = _t((dst[:, None] * G + np.arange(G)).reshape(-1), dev)
        for t in {id(t): t for t in (self.own_mask, self.fill, self.fed, self.pos, self.last, self.logits)}.values():
            t[rd_t] = t[rs_t]

    def fork(self, par: np.ndarray, kid: np.ndarray) -> None:
        """Children ``kid`` take their parents' positions, tokens fed and pending logits."""
        par_t, kid_t = _t(par, self.device), _t(kid, self.device)
        for t in (self.fed, self.pos, self.logits):
            t[kid_t] = t[par_t]

    # ------------------------------------------------------------------- decode
    def _write_slots(self, hi: int) -> None:
        """Tree rollouts, before a step: where each row of ``[:hi]`` writes its new K/V (own
        slot, or its node's segment slot at a fork level; non-writers: the trash slot) and
        the slots revealed, from ``fed`` (device tensors only: no host values)."""
        tree = self.tree
        fed, live = self.fed[:hi], self.live_d[:hi].bool()
        at_own = live & (fed >= tree.own_start)
        torch.clamp(fed - tree.own_start, min=0, out=self.fill[:hi])
        self.own_mask[:hi].scatter_(1, self.fill[:hi, None], torch.where(at_own, self.zero, self.hide)[:, None])
        for k in range(tree.depth):
            writer = live & (fed >= tree.start(k)) & (fed < tree.end(k))
            self.fork_slot[k][:hi] = torch.where(writer, fed - tree.start(k), tree.trash(k))
            self.fork_mask[k].index_put_((self.fork_node[k][:hi], self.fork_slot[k][:hi]),
                                         torch.where(writer, self.zero, self.hide))

    def decode(self, hg: int, own_len: int, pre_len: int) -> None:
        """Feed every live row of group slots ``[:hg]`` its last sampled token, attending to
        ``own_len`` own and ``pre_len`` prompt slots; logits of rows ``[:hg x G]``."""
        hi = hg * self.G
        if self.tree.depth:
            self._write_slots(hi)
        else:
            self.own_mask[:hi].scatter_(1, self.fill[:hi, None], 0.0)
        step = self.steps_cache.get((hg, own_len))
        if step is None or step.cache is not self.cache:
            step = self.steps_cache[(hg, own_len)] = DecodeStep(self.e, self, hg, own_len, pre_len)
            self.stats.step_builds += 1
        elif not self.e.static_kv:  # exact shapes: the attended prompt slots change
            step.prefix_mask = self.prefix_mask[:hg, None, None, :pre_len]
        step()  # writes the logits of rows [:hi] into self.logits
        self.fed += self.live_d  # plain groups: ``fed`` is ``fill``
        self.pos += self.live_d

    # ----------------------------------------------------------------- sampling
    def sample(self, k: int, rows: np.ndarray | None, hi: int, how: RowSampling, generator: torch.Generator) -> None:
        """Sample the next token of rows ``[:hi]`` (``rows`` None: fixed shapes, after a decode
        step) or of ``rows`` (after an admission) from their pending logits, as ``how`` says
        (one setting for all, or per row); log it at ``k``."""
        idx = slice(0, hi) if rows is None else _t(rows, self.device)
        logits = self.logits[idx]
        # after a decode step: straight into the log (untruncated sampling writes there itself)
        out = (self.log_tok[k, :hi], self.log_lp[k, :hi]) if rows is None else (None, None)
        if how.params is not None:
            tokens, logp = sample(logits, how.params, generator, *out)
        else:
            tokens, logp = sample_rows(logits, *self._row_settings(how), generator, how.seeds, how.truncate, *out)
        self.last[idx] = tokens
        if tokens is not out[0]:
            self.log_tok[k, idx] = tokens
            self.log_lp[k, idx] = logp
        if how.top:  # the 20 most likely tokens under the behaviour distribution (the host keeps each group's k)
            if self.log_topi is None:
                K, S = self.log_tok.shape
                self.log_topi = torch.zeros(K, S, TOP_LOGPROBS, dtype=torch.int64, device=self.device)
                self.log_topv = torch.zeros(K, S, TOP_LOGPROBS, dtype=self.log_lp.dtype, device=self.device)
            t = how.params.temperature if how.params is not None else self._row_settings(how)[0]
            wide = widened(logits)
            scale = (t if t > 0 else 1.0) if how.params is not None else torch.where(t > 0, t, 1.0).to(wide.dtype)[:, None]
            top = torch.log_softmax(wide / scale, dim=-1).topk(min(TOP_LOGPROBS, logits.shape[-1]), dim=-1)
            self.log_topi[k, idx, : top.indices.shape[-1]] = top.indices  # a vocabulary under 20 tokens: the rest 0
            self.log_topv[k, idx, : top.values.shape[-1]] = top.values

    def _row_settings(self, how: RowSampling) -> tuple[torch.Tensor, ...]:
        """The rows' ``temperature, top_p, top_k, min_p`` ``[B]`` on the device, in one upload,
        and none while they stay the same (they change only when rows are admitted or finish);
        without truncation only the temperature is read (the others: its tensor, unread)."""
        width = 4 if how.truncate else 1
        host = np.stack([how.temperature, how.top_p, how.top_k, how.min_p][:width]).astype(np.float64)
        key = (host.shape, host.tobytes())
        if self._settings_key != key:
            dev = self._upload(host)  # (float64, as the host's settings)
            rest = (dev[1], dev[2].to(torch.int64), dev[3]) if how.truncate else (dev[0],) * 3
            self._settings, self._settings_key = (dev[0], *rest), key
        return self._settings

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """A small host array on the device without a sync (pinned, asynchronous on CUDA)."""
        return to_device(np.ascontiguousarray(a), self.device)

    def start_read(self, k: int, top: bool = False) -> "LogRead":
        """Start copying the first ``k`` logged sample calls' tokens and logprobs ``[k, S]``
        (``top``: and the top tokens' ids and logprobs ``[k, S, 20]``) to the host: on CUDA
        into pinned memory, asynchronously (ordered before the next steps' writes to the
        log, on the same stream); :meth:`LogRead.result` waits for it."""
        parts = [self.log_tok[:k], self.log_lp[:k].double()]
        if top and self.log_topi is not None:
            parts += [self.log_topi[:k], self.log_topv[:k].double()]
        if self.device.type != "cuda":
            return LogRead([x.clone() for x in parts], None)
        host = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in parts]
        for h, x in zip(host, parts):
            h.copy_(x, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # (the copies' stream: the log's device's)
        return LogRead(host, event)

