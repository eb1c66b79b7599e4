"""The step's no-grad forwards run during its rollout (``rollout.overlap_forwards``, issue 25).

Decode at tens of rows is latency-bound and leaves the GPU's compute idle, while the step's
no-grad forwards (proximal and reference logprobs, critic values) are compute-bound. A
:class:`GroupForwards` runs those forwards on each group as soon as the rollout finishes
it, while the other groups still decode, and hands the results to the learner afterwards:

    rollout.generate_stream  --finished group-->  GroupForwards.add (its own small PrefixTree)
    Learner.train_on         -->  GroupForwards.take (per-sequence results, input order)

Exact: forwards are per-sequence quantities (logprob of token ``t`` given tokens ``< t``, a
critic's value at token ``t``), so a group's own tree gives each sequence what the whole
batch's tree gives it (float64 on CPU: equal to ~1e-15; tests/test_overlap.py). On a GPU in
bf16/float32 the values are not bitwise those of the batch's tree: a call over one group has
other matrix shapes than a call over the packed batch, so the GEMM and attention kernels may
tile and reduce differently (differences of the size of the dtype's rounding, like any
change of batch composition). Results are matched by content: a requested sequence takes
the values of any computed sequence it is a prefix of (a multi-turn episode's earlier turns
from its last turn's sequence; a turn cut to the episode's token budget from the uncut one),
and a sequence nothing covers is computed by the learner after the rollout, as without
overlap.

On CUDA the forwards go to a side stream (:class:`torch.cuda.Stream`): the host only launches
them between decode steps, and the GPU runs them beside the decode's CUDA-graph replays. The
side stream first waits for the work queued on the rollout's stream (the weights it reads
were written there); it reads the weights only (read-only during a rollout) and nothing of
the rollout's K/V arena; its outputs are read after the rollout, once the learner's stream
has waited for it (:meth:`GroupForwards.take`; ``generate_stream`` itself ends with a device
synchronisation). Each engine's model runs in the train/eval mode the sequential forwards
see (the rollout puts the policy in eval mode; after it, the sampler puts it back in train mode).

Where it applies: the embedded rollout engine, single-turn groups (as each finishes) and
multi-turn episodes (the sequences of episodes that ended at a turn, during the next turn's
rollout); agent rollouts and data-parallel training run their forwards after the rollout.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from typing import Callable, Iterator, Sequence

import torch

from .engine.tree import PrefixTree
from .engine.tree_engine import TreeEngine, TreeOutputs

__all__ = ["GroupForwards", "stream_groups"]


class GroupForwards:
    """No-grad forwards (``engines``: field name -> engine, e.g. ``reference_logprobs``)
    of sequences handed over during a rollout; ``autocast``: the learner's autocast
    context factory. ``side_stream``: on CUDA, launch them on a second stream (default);
    False: on the rollout's stream, between its decode steps (the A/B of the benchmark).

    Counters: ``sequences`` computed, ``seconds`` of host time spent in :meth:`add` (the
    rollout waits for it), ``gpu_seconds`` of the forwards' device time (CUDA events,
    known after :meth:`take`; on CPU the host time)."""

    def __init__(self, engines: dict[str, TreeEngine], autocast: Callable[[], contextlib.AbstractContextManager],
                 device: torch.device, side_stream: bool = True, modes: dict[str, bool] | None = None):
        self.engines, self.autocast, self.device = dict(engines), autocast, device
        # train (True) or eval mode per engine's model during its forwards: ``modes``, else the present one
        self.modes = {name: (modes or {}).get(name, e.model.training) for name, e in self.engines.items()}
        cuda = device.type == "cuda"
        self.stream = _side_stream(device) if cuda and side_stream else None
        self._batches: list[tuple[list[tuple[int, ...]], dict[str, TreeOutputs]]] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._previous_turn: list[tuple[int, ...]] = []
        self.sequences = 0
        self.seconds = 0.0
        self.gpu_seconds = 0.0

    # ----------------------------------------------------------------- during the rollout
    def add(self, seqs: Sequence[Sequence[int] | torch.Tensor]) -> None:
        """Launch the forwards of ``seqs`` (token ids; e.g. a finished group's samples) as
        one tree. No host synchronisation: the call returns once the kernels are queued (the
        per-tree-token values stay on the device; :meth:`take` splits them per sequence)."""
        if not seqs:
            return
        t0 = time.perf_counter()
        keys = [tuple(s.tolist() if isinstance(s, torch.Tensor) else (int(t) for t in s)) for s in seqs]
        tree = PrefixTree.from_sequences([torch.tensor(k, dtype=torch.int64) for k in keys])
        outs = {}
        with self._on_stream() as events, self.autocast(), torch.no_grad():
            for name, engine in self.engines.items():
                with _mode(engine.model, self.modes[name]):
                    outs[name] = engine.forward(tree)  # engine.logprobs(tree) without its host sync
        if events is not None:
            self._events.append(events)
        self._batches.append((keys, outs))
        self.sequences += len(keys)
        self.seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[tuple | None]:
        if self.device.type != "cuda":
            yield None
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.stream is None:
            start.record()
            yield start, end
            end.record()
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # weights written before the rollout
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            yield start, end
            end.record(self.stream)

    def turn_starts(self, contexts: Sequence[Sequence[int]]) -> None:
        """Multi-turn rollouts, before each turn: the sequences of the previous turn that
        no context of this turn extends (their episodes ended) are final: launch them.
        Contexts come in the order of the episodes still running, a subsequence of the
        previous turn's (:func:`treerl.tasks.env.run_episodes`)."""
        prev, ended, j = self._previous_turn, [], 0
        for ctx in contexts:
            ctx = list(ctx)
            while j < len(prev) and not (len(prev[j]) <= len(ctx) and tuple(ctx[: len(prev[j])]) == prev[j]):
                ended.append(prev[j])
                j += 1
            j += 1
        ended += prev[j:]
        self._previous_turn = []
        self.add(ended)

    def turn_ends(self, seqs: Sequence[Sequence[int] | torch.Tensor]) -> None:
        """Multi-turn rollouts, after each turn: each context with its action (in context order)."""
        self._previous_turn = [tuple(s.tolist() if isinstance(s, torch.Tensor) else s) for s in seqs]

    # -------------------------------------------------------------------- after it
    def take(self, seqs: Sequence[torch.Tensor], names: Sequence[str],
             dtype: torch.dtype) -> tuple[dict[str, list[torch.Tensor | None]], list[int]]:
        """Per field of ``names``, each sequence's ``[L - 1]`` values (CPU, ``dtype``; None
        for sequences no computed sequence covers) and the indices of those uncovered."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        host = []
        for _, outs in self._batches:  # one device-to-host copy per batch and field
            host.append({n: [t.to(dtype) for t in outs[n].per_sequence(outs[n].logprob.cpu())] for n in names})
        if self._events:
            torch.cuda.synchronize(self.device)
            self.gpu_seconds = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events = []
        elif self.device.type != "cuda":
            self.gpu_seconds = self.seconds
        index = sorted((k, b, i) for b, (keys, _) in enumerate(self._batches) for i, k in enumerate(keys))
        flat = [k for k, _, _ in index]
        out: dict[str, list[torch.Tensor | None]] = {n: [None] * len(seqs) for n in names}
        missing = []
        for j, s in enumerate(seqs):
            key = tuple(s.tolist())
            at = bisect.bisect_left(flat, key)  # the first computed sequence >= key: it has key as a prefix if any does
            if at == len(flat) or flat[at][: len(key)] != key:
                missing.append(j)
                continue
            _, b, i = index[at]
            for n in names:
                out[n][j] = host[b][n][i][: len(key) - 1]
        return out, missing


# On CUDA with a side stream, the rollout runs on a high-priority stream: when the forwards'
# kernels (side stream, default = lowest priority) hold the SMs, the block scheduler gives
# the decode's kernels the next free ones instead of queueing them behind whole forward
# kernels (the decode is a chain of ~500 small kernels a step: each wait adds up). False:
# the rollout on the caller's stream (bench/bench_grpo_step.py's ``stream-nopriority``).
DECODE_PRIORITY = True


def stream_groups(rollout, prompts: list[list[int]], params, ready: GroupForwards | None) -> list:
    """``rollout.generate(prompts, params)`` through its stream: each group, as it finishes,
    goes to ``ready.add`` (when given) while the others still decode."""
    groups = {}
    with _rollout_stream(ready):
        for g in rollout.generate_stream(prompts, params):
            groups[g.prompt_index] = g
            if ready is not None:
                ready.add([c.token_ids for c in g.completions])
    return [groups[i] for i in range(len(prompts))]


@contextlib.contextmanager
def _rollout_stream(ready: GroupForwards | None) -> Iterator[None]:
    """With ``ready``'s side stream (and :data:`DECODE_PRIORITY`): the block runs on a
    high-priority stream that first waits for the caller's (the weights the optimizer just
    wrote), and the caller's stream waits for it after. Whatever the rollout allocates there
    and keeps (``keep_stream_buffers``' arena) is used only after a stream synchronisation
    (``generate_stream`` ends with one), so it may be used on any stream later."""
    if ready is None or ready.stream is None or not DECODE_PRIORITY:
        yield
        return
    device = ready.stream.device
    caller = torch.cuda.current_stream(device)
    high = _high_priority_stream(device)
    high.wait_stream(caller)
    try:
        with torch.cuda.stream(high):
            yield
    finally:
        caller.wait_stream(high)


_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def _stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """One stream per (device, priority) for the process: the caching allocator keeps each
    stream's freed blocks for that stream, so a new stream every step would hold memory again."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if (device, priority) not in _STREAMS:
        _STREAMS[device, priority] = torch.cuda.Stream(device, priority=priority)
    return _STREAMS[device, priority]


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The forwards' stream: the lowest priority (0, as the default stream)."""
    return _stream(device, 0)


def _high_priority_stream(device: torch.device) -> torch.cuda.Stream:
    """The rollout's stream beside the forwards: a higher priority (-1) than theirs."""
    return _stream(device, -1)


@contextlib.contextmanager
def _mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    """``model`` in train (or eval) mode for the block, its mode restored after."""
    was = model.training
    if was != training:
        model.train(training)
    try:
        yield
    finally:
        if was != training:
            model.train(was)
