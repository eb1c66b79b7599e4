"""The MLP's SiLU gate, ``silu(gate) * up``, over the gate/up product's output, in one Triton kernel.

Above :data:`~treerl.rollout.small_products.MAX_ROWS` rows the decode step's gate/up product runs through cuBLAS
(its tiles fill the GPU there) and its output ``[M, 2 I]`` (gate columns, then up columns, as
:class:`~treerl.rollout.blocks.FusedProjections` holds the weights) goes through this kernel to ``[M, I]``: one
read of ``2 I`` columns and one write of ``I`` a row. Session 32, H200, Qwen3-0.6B's gate at 1,024 rows, every
layer's own buffer a replay: inductor's kernel for the same work, compiled for dynamic shapes as the decode parts
are (one graph for every bucket), 13.09 us a layer for 18.9 MB (1.44 TB/s; static shapes 7.71), this kernel 6.42
(2.94 TB/s); the tail 59.1 -> 53.1 us a layer, bench_rollout's 1,024 rows +1.4%.

Rounding as the modules round (:func:`~treerl.rollout.layer_math._tail` in eager mode): ``silu(gate)`` computed in
float32 from the 16-bit gate and rounded to the output's dtype, then the product with ``up`` in float32, rounded
once more — the same two roundings as :func:`~treerl.rollout.small_products.gated`. The float32 exponential and
division are Triton's approximate ones on CUDA (a few units of float32's last place, as in ``gated``), so a 16-bit
result may differ from eager's by one unit where silu's float32 value lies that close to a rounding boundary
(session 32's tests: at most one element in a thousand).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None

BLOCK = 1024  # columns of one row a program writes (8 elements a thread at 4 warps: 16-byte accesses)

if triton is not None:

    @triton.jit
    def silu_times(g, u, dt: tl.constexpr):
        """``round(round(silu(g)) * u)`` in ``dt`` from float32 ``g``/``u`` (the modules' two roundings; also the
        epilogue of :func:`~treerl.rollout.small_products.gated`)."""
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (act * u).to(dt)

    @triton.jit
    def _silu_gate_kernel(GU, Out, I, sgm, som, BLOCK: tl.constexpr):
        """Program (row, column block): ``Out[r, c] = round(round(silu(GU[r, c])) * GU[r, I + c])``."""
        r, b = tl.program_id(0), tl.program_id(1)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        row = GU + r.to(tl.int64) * sgm
        g = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(row + I + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + r.to(tl.int64) * som + cols, silu_times(g, u, Out.dtype.element_ty), mask=ok)


def runs_here(gate_up: torch.Tensor) -> bool:
    """Whether :func:`silu_gate` takes ``gate_up [M, 2 I]``: Triton on CUDA (or its interpreter on the CPU),
    16-bit or float32 values, contiguous columns, an even width."""
    on = gate_up.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and on and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0
            and gate_up.stride(1) == 1 and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32))


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [M, 2 I]`` (gate columns first) -> ``[M, I]`` in its dtype (see the
    module docstring for the rounding); :func:`runs_here` first."""
    if not runs_here(gate_up):
        raise ValueError(f"silu_gate: gate_up {tuple(gate_up.shape)} {gate_up.dtype} on {gate_up.device} is not a "
                         "[M, 2 I] 16-bit/float32 tensor with contiguous columns that Triton runs here")
    M, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(M, inner)
    if M:
        _silu_gate_kernel[(M, triton.cdiv(inner, BLOCK))](gate_up, out, inner, gate_up.stride(0), out.stride(0),
                                                         BLOCK=BLOCK, num_warps=4)
    return out
