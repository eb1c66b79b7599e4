"""Mixture-of-experts blocks (Qwen3-MoE) as treerl runs them: routing in the input
precision and the experts as grouped GEMMs.

:func:`install` replaces the ``forward`` of every sparse MoE block of a model (in place,
idempotent) with :func:`moe_forward`, so every path that calls the block — the Hugging Face
forward (the rollout's prefill, a reference), treerl's compiled training blocks
(:mod:`treerl.engine.decoder`) and its own decode blocks (:mod:`treerl.rollout.blocks`) — runs the
same math, which is Hugging Face's ``Qwen3MoeSparseMoeBlock`` reordered:

- the router: ``softmax(x W_r^T)`` in ``promote(dtype, float32)`` (HF: float32 always,
  which hides float64 exactness; identical for bf16/float32 models), top-k experts per
  token, optionally renormalised (``norm_topk_prob``), weights cast back to the input dtype;
- the experts: the ``N x k`` (token, expert) pairs sorted by expert and run as two grouped
  GEMMs (``torch.nn.functional.grouped_mm``: gate/up ``[S, H] x [E, H, 2I]``, down
  ``[S, I] x [E, I, H]``, one kernel each; in bf16 on CUDA no host sync, CUDA-graph safe),
  weighted and summed back per token. Where PyTorch's grouped kernel does not take the
  inputs (float64; float32/fp16 inside ``torch.compile``; dimensions not a multiple of 16
  bytes) the pairs go through one batched matmul over the experts, padded to the largest
  expert's load (exact; reads that load on the host: a graph break when compiled, and no
  CUDA-graph capture — decode MoE models in bf16 on CUDA).

The router's load-balancing loss (Switch / HF ``load_balancing_loss_func``) is
:mod:`treerl.moe_aux`'s job; :func:`moe_forward` hands its router probabilities to the
recorder active there (:func:`active_router_hook`).
"""

from __future__ import annotations

import threading
import types
from typing import Callable

import torch
import torch.nn.functional as F

MOE_BLOCKS = ("Qwen3MoeSparseMoeBlock",)

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_hook = threading.local()


def is_moe_block(module: torch.nn.Module) -> bool:
    return type(module).__name__ in MOE_BLOCKS


def is_moe_model(model: torch.nn.Module) -> bool:
    """Whether any block of ``model`` is a sparse MoE block treerl runs."""
    return any(is_moe_block(m) for m in model.modules())


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Run every sparse MoE block of ``model`` through :func:`moe_forward` (in place;
    idempotent; copies made with ``copy.deepcopy`` keep it). Returns ``model``."""
    for module in model.modules():
        if is_moe_block(module) and getattr(module.forward, "__func__", None) is not moe_forward:
            module.forward = types.MethodType(moe_forward, module)
    return model


def active_router_hook() -> Callable | None:
    """The function each router's probabilities go through, if one is active
    (:func:`router_hook`): ``hook(probs [N, E], top_index [N, k]) -> probs``."""
    return getattr(_hook, "fn", None)


class router_hook:
    """Context: every :func:`moe_forward` in this thread hands its router probabilities to
    ``fn(probs, top_index) -> probs`` (used by :mod:`treerl.moe_aux`)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __enter__(self):
        self.previous = getattr(_hook, "fn", None)
        _hook.fn = self.fn
        return self

    def __exit__(self, *exc):
        _hook.fn = self.previous


def route(gate: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [N, H]`` -> router probabilities ``[N, E]`` (``promote(dtype, float32)``), the
    top-k weights ``[N, k]`` (``x.dtype``) and expert ids ``[N, k]``."""
    logits = F.linear(x, gate.weight)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    top_w, top_i = torch.topk(probs, gate.top_k, dim=-1)
    hook = active_router_hook()
    if hook is not None:
        probs = hook(probs, top_i)
        top_w = probs.gather(1, top_i)
    if gate.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return probs, top_w.to(x.dtype), top_i


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Rows ``x [S, in]`` sorted by expert (``experts [S]``; expert ``e`` owns rows
    ``[ends[e-1], ends[e])``, ``ends`` int32 ``[E]``) times their expert's ``weight [E, out, in]``
    transposed -> ``[S, out]``."""
    w_t = weight.transpose(-2, -1)
    if _grouped_kernel_takes(x, w_t):
        return F.grouped_mm(x.to(weight.dtype), w_t, offs=ends)
    # float64 / unaligned shapes: one batched matmul over the experts, padded to the largest load
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    slot = torch.arange(x.shape[0], device=x.device) - (ends - counts).long()[experts]
    cap = int(counts.max()) if x.shape[0] else 0
    padded = x.new_zeros(weight.shape[0], cap, x.shape[1]).index_put((experts, slot), x)
    return torch.bmm(padded, w_t.to(x.dtype))[experts, slot]


def _grouped_kernel_takes(x: torch.Tensor, w_t: torch.Tensor) -> bool:
    """PyTorch's grouped GEMM: bf16/fp16/float32 (bf16 only inside ``torch.compile``, whose
    shape function refuses the others), strides multiples of 16 bytes."""
    size = w_t.element_size()
    dtypes = (torch.bfloat16,) if torch.compiler.is_compiling() else _GROUPED_DTYPES
    return (w_t.dtype in dtypes and x.dtype == w_t.dtype and (w_t.shape[-1] * size) % 16 == 0
            and (w_t.shape[-2] * size) % 16 == 0)


def experts_forward(experts: torch.nn.Module, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """HF ``Qwen3MoeExperts`` (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) on
    ``x [N, H]`` routed to ``top_i [N, k]`` with weights ``top_w [N, k]`` -> ``[N, H]``."""
    N, k = top_i.shape
    E = experts.gate_up_proj.shape[0]
    flat = top_i.reshape(-1)
    expert_sorted, perm = torch.sort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, expert_sorted, torch.ones_like(expert_sorted, dtype=torch.int32))
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = x[perm // k]
    gate, up = grouped_linear(rows, experts.gate_up_proj, ends, expert_sorted).chunk(2, dim=-1)
    out = grouped_linear(experts.act_fn(gate) * up, experts.down_proj, ends, expert_sorted)
    out = out * top_w.reshape(-1)[perm, None].to(out.dtype)
    unsorted = torch.empty_like(out).index_copy_(0, perm, out)
    return unsorted.view(N, k, -1).sum(dim=1).to(x.dtype)


def moe_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A sparse MoE block's forward (installed by :func:`install`): ``[..., H]`` -> ``[..., H]``."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, top_w, top_i = route(self.gate, x)
    return experts_forward(self.experts, x, top_i, top_w).reshape(shape)
