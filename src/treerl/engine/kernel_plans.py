"""Which kernel each chain or group call's shape runs, and cuDNN's plans per shape (issue 24).

The fused kernels' calls run on lengths on a grid (:class:`Layout`; :mod:`treerl.engine.chain_attention`'s
"Lengths on a grid"), so a call's shape is its (rows, prefix keys) pair there. cuDNN builds an execution plan
for each new shape (forward and backward, ~0.26 s on an H200, ~6.8 MiB of host memory kept: session 35's
``bench/cudnn_plans.py``). :func:`planned` keeps cuDNN for a shape it has planned, and plans a new one while the
running engine call (:func:`engine_call`) has room under :data:`CUDNN_NEW_SHAPES_PER_CALL` and the process
under :data:`CUDNN_MAX_SHAPES`; otherwise the call takes the next kernel that passed the probe (flash), exactly
the same math, and a later call plans the shape. :func:`plans_room` says beforehand whether every part of a
root split would keep cuDNN. :data:`SHAPES` records the shapes each kernel ran.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

if TYPE_CHECKING:
    from .chain_attention import Kernel

# New (rows, prefix keys) shapes that cuDNN may build plans for in one engine call (a forward or a
# forward_backward: engine_call; each shape ~0.1-0.3 s of forward and backward plans): the call's
# other new shapes take the next kernel that passed the probe, and a later call plans them, so the shapes
# a run meets again all reach cuDNN while no call pays for more than this many plans (None: no bound).
CUDNN_NEW_SHAPES_PER_CALL: int | None = 8
# Distinct shapes that cuDNN may plan in this process, per kernel label (None: no bound): torch keeps every
# plan, ~6.8 MiB of host memory each (H200, session 35: bench/cudnn_plans.py), so 512 hold ~3.4 GiB; a run
# whose trees change every step met 384 distinct shapes in 300 steps of 32k-token prompts, 43 on 12-turn
# episodes (bench/cudnn_shapes_sim.py).
CUDNN_MAX_SHAPES: int | None = 512


@dataclass(frozen=True)
class Layout:
    """Where ``n`` queries after ``prefix`` keys sit in their kernel calls on a grid of ``align``
    (module docstring, "Lengths on a grid"): ``front`` prefix keys move to the own part;
    ``full_keys`` (= prefix - front) keys make the full part; the kernels run ``rows`` query
    rows, the real ones from row ``lead``. A chain (``causal``): its causal part runs the moved
    keys and its own, so ``lead = front`` dummy rows precede the queries and the causal part
    has ``rows`` keys. A group (:mod:`treerl.engine.group_attention`): the own part is not a
    kernel call, the queries lead (``lead = 0``) and dummy rows follow them."""

    n: int
    prefix: int
    front: int
    full_keys: int
    rows: int
    lead: int

    @classmethod
    def of(cls, n: int, prefix: int, align: int = 1, causal: bool = True) -> "Layout":
        front = prefix % align
        lead = front if causal else 0
        return cls(n, prefix, front, prefix - front, -(-(lead + n) // align) * align, lead)

    @property
    def padded(self) -> bool:
        return self.rows != self.n

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, n, D] as the kernels get it: [B, H, rows, D], zero dummy rows around it."""
        if not self.padded:
            return q
        b, h, n, d = q.shape
        rows = q.new_zeros(b, self.rows, h, d).transpose(1, 2)  # the engine's layout: [B, H, N, D] of [B, N, H, D]
        rows[:, :, self.lead:self.lead + n] = q
        return rows

    def inputs(self, q, k, v):
        """A chain's queries as the kernels get them, and its causal part's K/V."""
        if not self.padded:
            return q, k[:, :, self.prefix:], v[:, :, self.prefix:]
        own = self.front + self.n
        k_own, v_own = (x.new_zeros(*x.shape[:2], self.rows, x.shape[3]) for x in (k, v))
        k_own[:, :, :own] = k[:, :, self.full_keys:]
        v_own[:, :, :own] = v[:, :, self.full_keys:]
        return self.queries(q), k_own, v_own

    def real(self, x: torch.Tensor) -> torch.Tensor:
        """The real queries' rows of a [B, H, rows, ...] tensor (a view)."""
        return x.narrow(2, self.lead, self.n) if self.padded else x

    def padded_grad(self, dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """dout [B, H, n, D] on ``out``'s rows (laid out as it): zero for the dummy rows, so
        that they add to no dK/dV (``dS = P (dO V^T - rowsum(dO O)) = 0``)."""
        if not self.padded:
            return dout
        grad = torch.zeros_like(out)
        self.real(grad).copy_(dout)
        return grad


# Per kernel label: the distinct (device, dtype, heads, KV heads, head dim, rows, prefix keys)
# of the calls it ran (cuDNN builds a plan for each new one).
SHAPES: dict[str, set] = {}
# engine calls running (engine_call: nested ones share the outermost's allowance), the new cuDNN shapes planned since
# the outermost began, and whether it deferred one for want of its allowance (the counts stay after it ends)
_call_depth = 0
_call_new_shapes = 0
_call_deferred = False


@contextlib.contextmanager
def engine_call() -> Iterator[None]:
    """One engine call's allowance of new cuDNN shapes (:data:`CUDNN_NEW_SHAPES_PER_CALL`), around a
    ``TreeEngine.forward`` or ``forward_backward``. Within it the count only grows, so a shape refused in a
    block's forward is refused in its recompute too (the backward's recompute runs on autograd's thread: the
    count is the process's, not a thread's). A call inside another (a loss that runs an engine call; the router
    loss's forward and forward_backward on one tree) shares the outermost's allowance, so the two see the same
    kernels. Engine calls of two threads at once are not supported. Outside any (tree attention without an
    engine) only :data:`CUDNN_MAX_SHAPES` bounds new shapes."""
    global _call_depth, _call_new_shapes, _call_deferred
    if _call_depth == 0:
        _call_new_shapes, _call_deferred = 0, False
    _call_depth += 1
    try:
        yield
    finally:
        _call_depth -= 1


def call_deferred() -> bool:
    """Whether the last (or running) engine call sent a new shape to the fallback, or kept a root split's tree
    mask, for want of its allowance (a later call plans it)."""
    return _call_deferred


def _may_plan(planned_shapes: int, new: int) -> bool:
    """Whether cuDNN may plan ``new`` more shapes of a kernel after ``planned_shapes``: room in the process
    (:data:`CUDNN_MAX_SHAPES`), then in the running engine call's allowance, whose want is recorded
    (:func:`call_deferred`)."""
    global _call_deferred
    if CUDNN_MAX_SHAPES is not None and planned_shapes + new > CUDNN_MAX_SHAPES:
        return False
    if _call_depth == 0 or CUDNN_NEW_SHAPES_PER_CALL is None or _call_new_shapes + new <= CUDNN_NEW_SHAPES_PER_CALL:
        return True
    _call_deferred = True
    return False


def planned(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, fallback: Callable[[], Kernel | None],
            causal: bool = True) -> Kernel:
    """``kernel`` for this call's shape (recorded in :data:`SHAPES`), unless it is cuDNN, the
    shape is new and cuDNN may plan no more (:data:`CUDNN_NEW_SHAPES_PER_CALL` planned in this
    engine call already, or :data:`CUDNN_MAX_SHAPES` in the process): then ``fallback()`` (the
    next kernel that passed the probe), if there is one. Within an engine call deterministic per
    shape, so a block's recompute takes the kernel its forward took. ``causal``: a chain's
    (a full and a causal part) or a group's (a full part only; none without full keys)."""
    n = q.shape[2]

    def shape(kernel: Kernel) -> tuple:
        return _shape(kernel, q.device, q.dtype, q.shape[1], k.shape[1], q.shape[3], n, k.shape[2] - n, causal)

    key = shape(kernel)
    if not causal and key[-2] == 0:
        return kernel  # a group without full keys runs no kernel (the tree mask instead)
    global _call_new_shapes
    seen = SHAPES.setdefault(kernel.label, set())
    if key in seen or kernel.name != "cudnn":
        seen.add(key)
        return kernel
    if not _may_plan(len(seen), 1):
        other = fallback()
        if other is not None:
            SHAPES.setdefault(other.label, set()).add(shape(other))
            return other
    seen.add(key)
    _call_new_shapes += 1
    return kernel


def _shape(kernel: Kernel, device, dtype, heads: int, kv_heads: int, dim: int, n: int, prefix: int,
           causal: bool) -> tuple:
    """The key of :data:`SHAPES` for ``n`` queries after ``prefix`` keys on ``kernel``'s grid."""
    layout = Layout.of(n, prefix, kernel.align, causal)
    return (str(device), dtype, heads, kv_heads, dim, layout.rows, layout.full_keys, causal)


def plans_room(kernel: Kernel, device, dtype, heads: int, kv_heads: int, dim: int,
               parts: list[tuple[int, int, bool]]) -> bool:
    """Whether :func:`planned` would keep ``kernel`` for every one of ``parts`` ((queries, prefix keys,
    causal) each, one model call's kernel calls): cuDNN has planned their shapes already or may plan the
    new ones (:data:`CUDNN_NEW_SHAPES_PER_CALL`, :data:`CUDNN_MAX_SHAPES`; records no shape, only a deferral:
    :func:`call_deferred`)."""
    if kernel.name != "cudnn":
        return True
    seen = SHAPES.get(kernel.label, set())
    new = {_shape(kernel, device, dtype, heads, kv_heads, dim, *part) for part in parts} - seen
    return not new or _may_plan(len(seen), len(new))
