"""Per-request (per-group) concerns of the running batch's host side: how to sample a set
of rows whose groups bring their own settings (:func:`plan_sampling`), a row's output
(:func:`row_completion`, and :func:`row_delta` for its group's listener: :func:`emit`,
:func:`notify`), and stopping a cancelled group (:func:`abort`). Functions of the
:class:`~treerl.rollout.scheduler.Scheduler`'s state."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from .params import SamplingParams
from .sampling import row_seed
from .types import Completion, Group, TokenDelta

if TYPE_CHECKING:  # pragma: no cover
    from .scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class RowSampling:
    """How to sample a set of rows: ``params`` (one setting for all), or per row
    ``temperature``, ``top_p``, ``top_k``, ``min_p`` arrays, ``seeds`` ``{row index: seed}``
    and ``truncate`` (any top-k/top-p/min-p)."""

    params: SamplingParams | None = None
    temperature: np.ndarray | None = None
    top_p: np.ndarray | None = None
    top_k: np.ndarray | None = None
    min_p: np.ndarray | None = None
    seeds: dict | None = None
    truncate: bool = False
    top: int = 0  # top tokens to log (the most any of the rows' groups asks for)



def notify(listener: Callable | None, delta: TokenDelta) -> bool:
    """Call ``listener`` with ``delta``; False (logged) if it raised: drop it (a client's
    callback never kills the stream)."""
    if listener is None:
        return True
    try:
        listener(delta)
        return True
    except Exception:  # noqa: BLE001
        log.exception("the listener of group %r raised; it gets no more tokens", delta.prompt_index)
        return False


def plan_sampling(s: "Scheduler", rows: np.ndarray, span: np.ndarray) -> RowSampling:
    """How to sample ``span`` (rows of ``s``, in order) of which ``rows`` are live: the
    stream's settings when every live row has them (the fast path), one common setting, or
    per row (with the seeds of seeded rows: their group's seed, branch and token index)."""
    slots = np.unique(rows // s.G)
    top = int(s.top_n[slots].max(initial=0))
    if not s.custom[slots].any():
        return RowSampling(s.p, top=top)
    fields = (s.temperature, s.top_p, s.top_k, s.min_p)
    if (s.seed[slots] < 0).all() and all(len(np.unique(f[slots])) == 1 for f in fields):
        t, tp, tk, mp = (f[slots[0]].item() for f in fields)
        return RowSampling(SamplingParams(temperature=t, top_p=tp, top_k=tk, min_p=mp), top=top)
    g = span // s.G
    seeds = {}
    where = {int(r): i for i, r in enumerate(span)}
    for r in rows[s.seed[rows // s.G] >= 0]:
        slot, p = divmod(int(r), s.G)
        branch = s.tree.branch(p, int(s.level[slot]))
        seeds[where[int(r)]] = row_seed(int(s.seed[slot]), branch, int(s.steps[r]))
    truncate = bool(((s.top_k[slots] > 0) | (s.top_p[slots] < 1) | (s.min_p[slots] > 0)).any())
    return RowSampling(None, s.temperature[g], s.top_p[g], s.top_k[g], s.min_p[g], seeds, truncate, top)


def _tops(s: "Scheduler", r: int, a: int, b: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return s.top_id[r, a:b, :k].copy(), s.top_lp[r, a:b, :k].copy()


def row_delta(s: "Scheduler", r: int, a: int, b: int, reason: str | None) -> TokenDelta:
    """Row ``r``'s tokens ``[a, b)`` as a :class:`~treerl.rollout.types.TokenDelta`."""
    key = s.key[r]
    k = s.groups[key].params.top_logprobs
    slot, p = divmod(int(r), s.G)
    level = s.tree.depth_of(b) if reason is not None else int(s.level[slot])
    top = None
    if k:
        ids, lps = _tops(s, r, a, b, k)
        top = [list(zip(i.tolist(), lp.tolist())) for i, lp in zip(ids, lps)]
    return TokenDelta(key, s.tree.branch(p, level), s.host_tok[r, a:b].tolist(), s.host_lp[r, a:b].tolist(),
                      s.host_ver[r, a:b].tolist(), top, reason)


def row_completion(s: "Scheduler", r: int, length: int, reason: str, stop) -> Completion:
    """Row ``r``'s first ``length`` tokens as a finished :class:`~treerl.rollout.types.Completion`."""
    key = s.key[r]
    g = s.groups[key]
    k = g.params.top_logprobs
    top = None
    if k:
        ids, lps = _tops(s, r, 0, length, k)
        top = (torch.from_numpy(ids), torch.from_numpy(lps).to(s.logit_dtype))
    return Completion(
        prompt_index=key,
        prompt_ids=g.prompt_ids,
        completion_ids=torch.from_numpy(s.host_tok[r, :length].copy()),
        logprobs=torch.from_numpy(s.host_lp[r, :length].copy()).to(s.logit_dtype),
        versions=torch.from_numpy(s.host_ver[r, :length].copy()),
        finish_reason=reason,
        stop=stop,
        branch=s.tree.branch(int(r) % s.G, s.tree.depth_of(length)),
        top_logprobs=top,
    )


def emit(s: "Scheduler", r: int, end: int, reason: str | None) -> None:
    """Give row ``r``'s tokens ``[emitted, end)`` (and its ``reason`` if it finished) to its
    group's listener; a listener that raises is logged and dropped."""
    g = s.groups[s.key[r]]
    delta = row_delta(s, r, int(s.emitted[r]), end, reason)
    s.emitted[r] = end
    if not notify(g.listener, delta):
        g.listener = None


def abort(s: "Scheduler", key) -> bool:
    """(Synced.) Stop group ``key`` (cancelled): a running group's live rows finish with
    their tokens so far and ``finish_reason="abort"``; a preempted or not yet admitted one
    is taken from the deferred groups and finished the same way (its ``n`` samples empty
    if it never ran). The group is queued in ``s.out``. False if the batch does not hold it."""
    if key in s.gkey:
        rows = s.slot_rows([s.gkey.index(key)])
        for r in rows[s.live[rows]]:
            s.finish(int(r), int(s.steps[r]), "abort", None)
        return True
    for i, item in enumerate(s.deferred):
        if item.key == key:
            del s.deferred[i]
            s.out.append(abort_deferred(s, item))
            return True
    return False


def abort_deferred(s: "Scheduler", item) -> Group:
    """The group of a cancelled ``item`` that waits outside the batch, finished with
    ``finish_reason="abort"``: a preempted group's rows with their tokens so far, or a
    prompt never admitted with ``n`` empty samples. Listeners get their last deltas."""
    key = item.key
    if hasattr(item, "rows"):  # preempted: its rows' saved host state, finished as they are
        g = s.groups.pop(key)
        a = item.rows
        for p in np.flatnonzero(a["live"]):
            n, e = int(a["steps"][p]), int(a["emitted"][p])
            branch = s.tree.branch(int(p), s.tree.depth_of(n))
            tok, lp, ver = (a[name][p, :n].copy() for name in ("host_tok", "host_lp", "host_ver"))
            k = g.params.top_logprobs
            ids, lps = a["top_id"][p, :n, :k].copy(), a["top_lp"][p, :n, :k].copy()
            delta_top = [list(zip(i.tolist(), x.tolist())) for i, x in zip(ids[e:], lps[e:])] if k else None
            notify(g.listener, TokenDelta(key, branch, tok[e:].tolist(), lp[e:].tolist(), ver[e:].tolist(), delta_top,
                                          "abort"))
            g.completions.append(Completion(key, g.prompt_ids, torch.from_numpy(tok),
                                            torch.from_numpy(lp).to(s.logit_dtype), torch.from_numpy(ver),
                                            "abort", None, branch,
                                            (torch.from_numpy(ids), torch.from_numpy(lps).to(s.logit_dtype))
                                            if k else None))
            s.stats.generated_tokens += n
        g.completions.sort(key=lambda c: c.branch)
        return Group(key, g.prompt_ids, g.completions)
    params = s.p if item.params is None else item.params
    prompt = torch.tensor([int(t) for t in item.prompt], dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    done = [Completion(key, prompt, empty, torch.zeros(0, dtype=s.logit_dtype), empty, "abort", None, (j,))
            for j in range(params.n)]
    for c in done:
        notify(item.listener, TokenDelta(key, c.branch, [], [], [], None, "abort"))
    return Group(key, prompt, done)
