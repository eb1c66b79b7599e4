"""Every Triton kernel of the decode step compiles for Hopper (sm_90) on the CPU, as its launcher calls it.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on the CPU and checks its numbers, but it does not
type-check the kernel as the compiler does: session 12 sent a kernel to the GPU whose loop reused an ``int32`` loop
variable as a float, which the interpreter ran and the compiler refused. These tests run each launcher on small CPU
tensors with its kernel replaced by a recorder, then compile every recorded launch ahead of time for an H100/H200
(``triton.compile`` with a ``GPUTarget``: front end, LLVM and ``ptxas``, no GPU needed).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from treerl.rollout import decode_attention, race_kernel, rope_kernel  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _compile(recorder: _Recorder) -> int:
    """Compiles each recorded launch for sm_90; returns how many."""
    kernel = recorder.kernel
    names = kernel.arg_names
    for args, kwargs in recorder.calls:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(names, args)) | kwargs
        assert set(values) == set(names), f"{kernel.__name__}: arguments {sorted(set(names) - set(values))} not given"
        constexpr = {p.name for p in kernel.params if p.is_constexpr}
        signature = {n: "constexpr" if n in constexpr else _arg_type(values[n]) for n in names}
        constants = {(names.index(n),): values[n] for n in constexpr}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=HOPPER,
                                  options=options)
        assert compiled.asm["cubin"], kernel.__name__
    return len(recorder.calls)


@pytest.fixture
def record(monkeypatch):
    def install(module, name: str) -> _Recorder:
        recorder = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorder)
        return recorder
    return install


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_attention_compiles_for_hopper(record, dtype):
    """The split kernel: the prompt part's ranges (dense), the own part (paged, through a block table) with and
    without the merge in its epilogue, both dense and paged."""
    kernel = record(decode_attention, "_split_kernel")
    B, G, H, gq, N, D, page = 4, 2, 2, 2, 96, 64, 16
    q_pre = torch.randn(B // G, H, G * gq, D, dtype=dtype)
    k, v = torch.randn(B // G, H, N, D, dtype=dtype), torch.randn(B // G, H, N, D, dtype=dtype)
    mask = torch.zeros(B // G, N, dtype=dtype)
    o_pre, l_pre = decode_attention.split_attention(q_pre, k, v, mask, 0.125, splits=2)
    q = torch.randn(B, H, gq, D, dtype=dtype)
    own_k, own_v = torch.randn(B, H, 32, D, dtype=dtype), torch.randn(B, H, 32, D, dtype=dtype)
    own_mask = torch.zeros(B, 32, dtype=dtype)
    pk, pv, table = decode_attention.to_pages(own_k, own_v, page)
    table = table.to(torch.int32)
    decode_attention.split_attention(q, pk, pv, own_mask, 0.125, table=table)
    for paged in (False, True):
        kv = (pk, pv) if paged else (own_k, own_v)
        decode_attention.split_attention_merged(q, *kv, own_mask, 0.125, o_pre, l_pre, G, dtype,
                                                table=table if paged else None)
    assert _compile(kernel) == 4


@pytest.mark.parametrize("norm", [False, True])
def test_rope_write_compiles_for_hopper(record, norm):
    kernel = record(rope_kernel, "_rope_write_kernel")
    B, G, heads, kv_heads, D, page = 4, 2, 4, 2, 64, 16

    class Norm(torch.nn.Module):
        weight = torch.ones(D, dtype=torch.bfloat16)
        variance_epsilon = 1e-6

    qkv = torch.randn(B, 1, (heads + 2 * kv_heads) * D, dtype=torch.bfloat16)
    cos, sin = torch.randn(B, 1, D, dtype=torch.bfloat16), torch.randn(B, 1, D, dtype=torch.bfloat16)
    own_k = torch.zeros(8, kv_heads, page, D, dtype=torch.bfloat16)
    rope_kernel.rope_write(qkv, cos, sin, Norm() if norm else None, Norm() if norm else None, heads, kv_heads, G,
                           own_k, own_k.clone(), torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    assert _compile(kernel) == 1


def test_race_kernel_compiles_for_hopper(record):
    partial, combine = record(race_kernel, "_partial"), record(race_kernel, "_combine")
    logits = torch.randn(3, 1000, dtype=torch.float32)
    race_kernel.race_kernel(logits, torch.full((3,), 0.7), torch.arange(3, dtype=torch.int64))
    race_kernel.race_kernel(logits.bfloat16(), torch.ones(1), torch.arange(3, dtype=torch.int64))
    assert _compile(partial) == 2 and _compile(combine) == 2
