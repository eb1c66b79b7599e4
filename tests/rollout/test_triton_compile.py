"""Every Triton kernel (the decode step's, the loss head's) compiles for Hopper (sm_90) on the CPU, as its launcher calls it.

Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python on the CPU and checks its numbers, but it does not
type-check the kernel as the compiler does: session 12 sent a kernel to the GPU whose loop reused an ``int32`` loop
variable as a float, which the interpreter ran and the compiler refused. These tests run each launcher on small CPU
tensors with its kernel replaced by a recorder, then compile every recorded launch ahead of time for an H100/H200
(``triton.compile`` with a ``GPUTarget``: front end, LLVM and ``ptxas``, no GPU needed). The launch's signature,
its arguments specialised to constants (integers equal to 1) and its divisibility hints come from Triton's own
binder, as the runtime builds them (private API of the pinned Triton 3.6.0), so the compiled variant is the one the
GPU compiles; each must fit an SM's shared memory.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":  # (the interpreter's kernels are Python functions: nothing to compile)
    pytest.skip("compiles kernels; TRITON_INTERPRET=1 interprets them", allow_module_level=True)
triton = pytest.importorskip("triton")
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from helpers.hopper import HOPPER, Recorder as _Recorder, compile_launches as _compile  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from treerl.rollout import decode_attention, race_kernel, rope_kernel, silu_gate, small_products  # noqa: E402


@pytest.fixture
def record(monkeypatch):
    def install(module, name: str) -> _Recorder:
        recorder = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorder)
        return recorder
    return install


@pytest.mark.parametrize("dtype, page, G, gq, D", [
    (torch.bfloat16, 64, 8, 2, 128),  # Qwen3's decode (16 query heads over 8 KV heads), the default block of 64
    (torch.bfloat16, 16, 2, 2, 64),  # a block smaller than the key tile
    (torch.float16, 128, 1, 1, 64),  # one row a group, one query a head: the arguments equal to 1 are constants
    (torch.float32, 64, 4, 2, 64),  # float32 (its products in IEEE float32)
])
def test_split_attention_compiles_for_hopper(record, dtype, page, G, gq, D):
    """The split kernel: the prompt part's ranges (dense), the rows' own part (paged, through a block table)
    with and without the merge in its epilogue, and the merge over dense keys."""
    kernel = record(decode_attention, "_split_kernel")
    B, H, N, own = 2 * G, 2, 96, 2 * page
    q_pre = torch.randn(B // G, H, G * gq, D, dtype=dtype)
    k, v = torch.randn(B // G, H, N, D, dtype=dtype), torch.randn(B // G, H, N, D, dtype=dtype)
    o_pre, l_pre = decode_attention.split_attention(q_pre, k, v, torch.zeros(B // G, N, dtype=dtype), 0.125)
    q = torch.randn(B, H, gq, D, dtype=dtype)
    own_k, own_v = torch.randn(B, H, own, D, dtype=dtype), torch.randn(B, H, own, D, dtype=dtype)
    own_mask = torch.zeros(B, own, dtype=dtype)
    pk, pv, table = decode_attention.to_pages(own_k, own_v, page)
    table = table.to(torch.int32)
    decode_attention.split_attention(q, pk, pv, own_mask, 0.125, table=table)
    for paged in (False, True):
        kv = (pk, pv) if paged else (own_k, own_v)
        decode_attention.split_attention_merged(q, *kv, own_mask, 0.125, o_pre, l_pre, G, dtype,
                                                table=table if paged else None)
    # the overlapped pair: the prompt part lets the next launch start, the merged own part (a dependent launch)
    # waits for it before its merge
    decode_attention.split_attention(q_pre, k, v, torch.zeros(B // G, N, dtype=dtype), 0.125, trigger=True)
    decode_attention.split_attention_merged(q, pk, pv, own_mask, 0.125, o_pre, l_pre, G, dtype, table=table,
                                            after=True)
    # ... and, as the small tail's chain follows it, lets the tail's first product start beside it
    decode_attention.split_attention_merged(q, pk, pv, own_mask, 0.125, o_pre, l_pre, G, dtype, table=table,
                                            after=True, trigger=True)
    # the prompt part as a link of the small-row chain after the rope kernel: it waits for it first, then lets the
    # own part start
    decode_attention.split_attention(q_pre, k, v, torch.zeros(B // G, N, dtype=dtype), 0.125, trigger=True,
                                     linked=True)
    compiled = _compile(kernel)
    assert len(compiled) == 8
    plain = "".join(c.asm["ptx"] for c in compiled[:4])
    assert "griddepcontrol" not in plain and not any(c.metadata.launch_pdl for c in compiled[:4])
    trigger, after, both, linked = compiled[4:]
    ptx = linked.asm["ptx"]
    assert linked.metadata.launch_pdl and ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert "griddepcontrol.launch_dependents" in trigger.asm["ptx"] and "griddepcontrol.wait" not in trigger.asm["ptx"]
    assert "griddepcontrol.wait" in after.asm["ptx"] and after.metadata.launch_pdl and not trigger.metadata.launch_pdl
    assert "griddepcontrol.launch_dependents" not in after.asm["ptx"]
    assert both.metadata.launch_pdl and all(f"griddepcontrol.{x}" in both.asm["ptx"] for x in ("launch_dependents", "wait"))


@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_merged_wide_key_tiles_compile_for_hopper(record, dtype, D):
    """The merged own part in 128-key tiles (``bench/serve_attention.py``'s variant, over blocks of 64 slots: a
    table entry per key) compiles for sm_90 within an SM's shared memory (bf16 heads of 128: 72 KB)."""
    kernel = record(decode_attention, "_split_kernel")
    B, H, gq, page = 4, 8, 2, 64
    own = 1088
    q = torch.randn(B, H, gq, D, dtype=dtype)
    pk, pv, table = decode_attention.to_pages(torch.randn(B, H, own, D, dtype=dtype),
                                              torch.randn(B, H, own, D, dtype=dtype), page)
    o_pre, l_pre = torch.zeros(B, H, 1, gq, D), torch.zeros(B, H, 1, gq)
    decode_attention.split_attention_merged(q, pk, pv, torch.zeros(B, own, dtype=dtype), 0.125, o_pre, l_pre, 1,
                                            dtype, table=table.to(torch.int32), block_n=128)
    assert kernel.calls[0][1]["BLOCK_N"] == 128 and len(_compile(kernel)) == 1


@pytest.mark.parametrize("dtype, G, M, S1, S2, Dv", [(torch.bfloat16, 1, 2, 66, 1, 128), (torch.float32, 8, 2, 3, 4, 64),
                                                   (torch.float16, 1, 1, 1, 1, 64)])
def test_merge_ranges_compiles_for_hopper(record, dtype, G, M, S1, S2, Dv):
    """The merge of the own part's key ranges with the prompt part's (one row a group and one query a head: the
    arguments equal to 1 are constants)."""
    kernel = record(decode_attention, "_merge_kernel")
    B, H = 2 * G, 8
    o_own, l_own = torch.randn(B, H, S1, M, Dv), torch.randn(B, H, S1, M)
    o_pre, l_pre = torch.randn(B // G, H, S2, G * M, Dv), torch.randn(B // G, H, S2, G * M)
    decode_attention.merge_ranges(o_own, l_own, o_pre, l_pre, G, dtype)
    assert len(_compile(kernel)) == 1


@pytest.mark.parametrize("dtype, T, L, Hq, H, D", [(torch.bfloat16, 128, 2048, 16, 8, 128),
                                                  (torch.bfloat16, 16, 256, 16, 8, 128),
                                                  (torch.float32, 40, 300, 4, 2, 64)])
def test_window_attention_compiles_for_hopper(record, dtype, T, L, Hq, H, D):
    """A prefill window's attention (``window_attention``): the split kernel's causal variant in query blocks,
    then the merge of its key ranges with no second part (``S2 = 0``)."""
    from treerl.rollout import window_attention as wa

    split, merge = record(decode_attention, "_split_kernel_any"), record(decode_attention, "_merge_kernel_any")
    q, k, v = torch.randn(2, Hq, T, D, dtype=dtype), torch.randn(2, H, L, D, dtype=dtype), torch.randn(2, H, L, D, dtype=dtype)
    wa.window_attention(q, k, v, torch.zeros(2, 1, T, L, dtype=dtype), 0.125)  # (outputs unwritten: recorded only)
    (args, kwargs), = split.calls
    assert kwargs["CAUSAL"] and kwargs["BLOCK_M"] == min(decode_attention.CAUSAL_QUERY_BLOCK,
                                                         max(16, triton.next_power_of_2(Hq // H * T)))
    merges = len(merge.calls)  # (one key range: no merge)
    assert len(_compile(split)) == 1 and merges <= 1 and len(_compile(merge)) == merges


def _variants(recorder: _Recorder) -> set:
    """The compiled variants the recorded launches need: Triton's binder's specialisation of each launch's
    arguments (divisibility, constants) with its constexprs and options, as the runtime keys its cache."""
    backend = make_backend(HOPPER)
    binder = create_function_from_signature(recorder.kernel.signature, recorder.kernel.params, backend)
    keys = set()
    for args, kwargs in recorder.calls:
        _, specialization, options = binder(*args, **dict(kwargs))
        keys.add((str(specialization), str(options)))
    recorder.calls.clear()
    return keys


def test_window_attention_compiles_one_kernel_per_query_tile(record):
    """A prefill window's attention needs one compiled split kernel per query tile (16, 32 or 64 queries a KV
    head) and one merge, whatever its sizes: the small prefills' buckets (powers of two) and chunked prefills of any
    length alike, so a new shape in a serving run compiles nothing (a compile stalls every row ~1 s: session 16
    calls 3-4); the engine's probe compiles the three tiles before serving (window_attention_ok)."""
    from treerl.rollout import window_attention as wa

    split, merge = record(decode_attention, "_split_kernel_any"), record(decode_attention, "_merge_kernel_any")
    by_tile = {}
    for R, T, C, Hq, H in ((1, 16, 256, 16, 8), (2, 16, 2048, 16, 8), (1, 64, 256, 16, 8), (1, 128, 2048, 16, 8),
                           (2, 128, 2048, 16, 8), (4, 256, 4096, 16, 8), (8, 64, 1024, 16, 8), (1, 512, 512, 16, 8),
                           (3, 37, 1234, 16, 8), (8, 1024, 1025, 16, 8), (1, 1, 999, 16, 8), (5, 9, 77, 16, 8),
                           (1, 7, 300, 4, 1), (2, 3, 45, 2, 2), (1, 1, 5, 4, 2)):
        q = torch.randn(R, Hq, T, 128, dtype=torch.bfloat16)
        k, v = torch.randn(R, H, C, 128, dtype=torch.bfloat16), torch.randn(R, H, C, 128, dtype=torch.bfloat16)
        wa.window_attention(q, k, v, torch.zeros(R, 1, T, C, dtype=torch.bfloat16), 0.125)
        tile = split.calls[-1][1]["BLOCK_M"]
        by_tile.setdefault(tile, set()).update(_variants(split))
    assert sorted(by_tile) == [16, 32, 64] and all(len(v) == 1 for v in by_tile.values()), by_tile
    assert len(_variants(merge)) == 1


@pytest.mark.parametrize("B, Hq, H, T", [(1, 16, 8, 4096), (2, 32, 8, 2048), (8, 64, 8, 1024), (1, 16, 8, 8192)])
def test_window_attention_grids_fit_cuda_for_long_prefills(record, B, Hq, H, T):
    """Long chunked prefills (a prompt of thousands of tokens; Qwen3-0.6B's 16, 8B's 32, 32B's 64 query heads):
    every launch's grid within CUDA's limits (y and z < 65,536); their query blocks fill the GPU in one key range,
    so no merge runs (its grid's y would be Hq x T: review of session 16)."""
    from treerl.rollout import window_attention as wa

    split, merge = record(decode_attention, "_split_kernel_any"), record(decode_attention, "_merge_kernel_any")
    q, k = torch.empty(B, Hq, T, 128, dtype=torch.bfloat16), torch.empty(B, H, T + 1, 128, dtype=torch.bfloat16)
    wa.window_attention(q, k, k, torch.zeros(B, 1, T, T + 1, dtype=torch.bfloat16), 0.125)
    assert not merge.calls and len(split.grids) == 1
    x, y, z = split.grids[0]
    assert y == 1 and x == B * H and z * decode_attention.CAUSAL_QUERY_BLOCK >= Hq // H * T and max(y, z) < 65536


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_attention_runs_large_groups_in_slices_that_fit(record, dtype):
    """A group's queries beyond one program's tile (``MAX_QUERIES``: 512 16-bit, 128 float32 queries of 128) run
    in slices of it, every query once, each launch within an SM's shared memory (float32's 256-query tile would
    take 263 KB)."""
    kernel = record(decode_attention, "_split_kernel")
    step = decode_attention.MAX_QUERIES[dtype == torch.float32]
    M, D, N = 2 * step + 8, 128, 300
    q = torch.randn(1, 2, M, D, dtype=dtype)
    k, v = torch.randn(1, 2, N, D, dtype=dtype), torch.randn(1, 2, N, D, dtype=dtype)
    out, lse = decode_attention.split_attention(q, k, v, torch.zeros(1, N, dtype=dtype), 0.125)
    starts = [args[0].data_ptr() for args, _ in kernel.calls]
    assert [args[0].shape[2] for args, _ in kernel.calls] == [step, step, 8]
    assert starts == [q.data_ptr() + m * q.stride(2) * q.element_size() for m in (0, step, 2 * step)]
    assert [args[4].data_ptr() for args, _ in kernel.calls] == [
        out.data_ptr() + m * out.stride(3) * out.element_size() for m in (0, step, 2 * step)]
    assert [args[5].data_ptr() for args, _ in kernel.calls] == [
        lse.data_ptr() + m * lse.stride(3) * lse.element_size() for m in (0, step, 2 * step)]
    kernel.calls[2:] = []  # (the largest tiles: the limit)
    _compile(kernel)


@pytest.mark.parametrize("D, heads, kv_heads, G", [(64, 4, 2, 2), (128, 16, 8, 16), (128, 8, 8, 1)])
def test_rope_write_compiles_for_hopper(record, D, heads, kv_heads, G):
    kernel = record(rope_kernel, "_rope_write_kernel")
    B, page = 2 * G, 64

    class Norm(torch.nn.Module):
        weight = torch.ones(D, dtype=torch.bfloat16)
        variance_epsilon = 1e-6

    qkv = torch.randn(B, 1, (heads + 2 * kv_heads) * D, dtype=torch.bfloat16)
    cos, sin = torch.randn(B, 1, D, dtype=torch.bfloat16), torch.randn(B, 1, D, dtype=torch.bfloat16)
    own_k = torch.zeros(8, kv_heads, page, D, dtype=torch.bfloat16)
    for norm in (None, Norm()):
        rope_kernel.rope_write(qkv, cos, sin, norm, norm, heads, kv_heads, G, own_k, own_k.clone(),
                               torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    # a link of the small-row chain: the product's float32 partials (2 ranges) summed, launched dependent
    partials = torch.randn(2, B, (heads + 2 * kv_heads) * D)
    rope_kernel.rope_write(partials, cos, sin, Norm(), Norm(), heads, kv_heads, G, own_k, own_k.clone(),
                           torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
                           dtype=torch.bfloat16, pdl=True)
    plain, normed, link = _compile(kernel)
    assert "griddepcontrol" not in plain.asm["ptx"] + normed.asm["ptx"] and not normed.metadata.launch_pdl
    ptx = link.asm["ptx"]
    assert link.metadata.launch_pdl and ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")  # (no read of the partials before the wait)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 128])
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_small_products_compile_for_hopper(record, monkeypatch, dtype, rows, tma):
    """The small-row products at Qwen3-0.6B's shapes after attention (the output product's and the down
    product's K ranges, the gated gate/up product), one row to ``MAX_ROWS``, bf16 and float32 (IEEE
    products), within an SM's shared memory at their default stages; their tiles through tensor descriptors
    (TMA copies in the PTX, as on sm_90+) or per-thread addresses."""
    monkeypatch.setattr(small_products, "_tma", lambda x, w: tma)
    partials, gated = record(small_products, "_partials_kernel"), record(small_products, "_gated_kernel")
    small_products.linear_partials(torch.zeros(rows, 2048, dtype=dtype), torch.zeros(1024, 2048, dtype=dtype))
    small_products.linear_partials(torch.zeros(rows, 3072, dtype=dtype), torch.zeros(1024, 3072, dtype=dtype))
    small_products.gated(torch.zeros(rows, 1024, dtype=dtype), torch.zeros(6144, 1024, dtype=dtype))
    compiled = _compile(partials) + _compile(gated)
    assert len(compiled) == 3
    assert all(("cp.async.bulk.tensor" in c.asm["ptx"]) == tma for c in compiled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_small_tail_chain_compiles_for_hopper(record, monkeypatch, dtype):
    """The block's tail as a chain of dependent launches (64 rows, Qwen3-0.6B's shapes): each product and the
    residual + RMSNorm let the next launch start, and wait for the kernel before them before any TMA copy of their
    tiles. The plain launches have neither."""
    names = ("_partials_kernel", "_gated_kernel", "_residual_norm_kernel")  # (their tiles by TMA: sm_90+, as the chain)
    monkeypatch.setattr(small_products, "_tma", lambda x, w: True)
    kernels = {name: record(small_products, name) for name in names}
    norm = Qwen3RMSNorm(1024).to(dtype)
    hidden = torch.zeros(64, 1, 1024, dtype=dtype)
    for pdl in (False, True):
        small_products.linear_partials(torch.zeros(64, 2048, dtype=dtype), torch.zeros(1024, 2048, dtype=dtype), pdl=pdl)
        small_products.gated(torch.zeros(64, 1024, dtype=dtype), torch.zeros(6144, 1024, dtype=dtype), pdl=pdl)
        small_products.residual_norm(hidden, torch.zeros(4, 64, 1024), torch.zeros(1024, dtype=dtype), norm, pdl=pdl)
    for name in names:
        plain, link = _compile(kernels[name])
        assert "griddepcontrol" not in plain.asm["ptx"] and not plain.metadata.launch_pdl
        ptx = link.asm["ptx"]
        assert link.metadata.launch_pdl and "griddepcontrol.launch_dependents" in ptx and "griddepcontrol.wait" in ptx
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")
        if name != "_residual_norm_kernel":  # (the products' TMA copies: none issued before the wait, even pipelined)
            assert "cp.async.bulk.tensor" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("cp.async.bulk.tensor")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_gate_compiles_for_hopper(record, monkeypatch, dtype):
    """The SiLU gate above the small-row kernels' rows (Qwen3-0.6B's 3,072 intermediate columns: three column
    blocks a row), bf16 and float32."""
    kernel = record(silu_gate, "_silu_gate_kernel")
    monkeypatch.setattr(silu_gate, "runs_here", lambda gate_up: True)  # (no CUDA here: compiled, not run)
    silu_gate.silu_gate(torch.zeros(1024, 6144, dtype=dtype))
    assert kernel.grids == [(1024, 3)] and len(_compile(kernel)) == 1


def test_race_kernel_compiles_for_hopper(record):
    """The sampling race over a vocabulary in split column ranges, and in one (``splits=1``), float32 and bf16
    logits, one temperature per row or one for all."""
    partial, combine = record(race_kernel, "_partial"), record(race_kernel, "_combine")
    logits = torch.randn(3, 5000, dtype=torch.float32)
    seeds = torch.arange(3, dtype=torch.int64)
    race_kernel.race_kernel(logits, torch.full((3,), 0.7), seeds)
    race_kernel.race_kernel(logits.bfloat16(), torch.ones(1), seeds)
    race_kernel.race_kernel(logits, torch.full((3,), 0.7), seeds, splits=1)
    assert len(_compile(partial)) == 3 and len(_compile(combine)) == 3


@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_kv_copy_compiles_for_hopper(record, dtype, D):
    """The K/V slot copy (an admitted row's context into its own blocks, a finished row's out
    of them), dense to paged and paged to dense, as its launcher calls it."""
    from treerl.rollout import kv_copy

    rec = record(kv_copy, "_copy_kernel")
    dense = torch.zeros(28, 4, 8, 300, D, dtype=dtype)
    pool = torch.zeros(28, 20, 8, 64, D, dtype=dtype)
    table = torch.zeros(4, 5, dtype=torch.int64)
    i64 = lambda *a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    kv_copy.copy_slots(dense, pool, i64(0, 3), i64(5, 0), i64(1, 2), i64(0, 0), i64(290, 100), 290, dst_table=table)
    kv_copy.copy_slots(pool, dense[:, :1], i64(2), i64(0), i64(0), i64(0), i64(290), 290, src_table=table)
    assert len(_compile(rec)) == 2


@pytest.mark.parametrize("dtype, entropy, block", [(torch.bfloat16, False, 4096), (torch.bfloat16, True, 4096),
                                                    (torch.float32, True, 16384)])
def test_loss_head_kernels_compile_for_hopper(record, dtype, entropy, block):
    """The training loss head's chunk kernels (:mod:`treerl.engine.head_kernel`): the forward (one online
    log-sum-exp a row) and the logits' gradient."""
    from treerl.engine import head_kernel

    forward, gradient = record(head_kernel, "_lse_kernel"), record(head_kernel, "_grad_kernel")
    raw, targets, rows = torch.randn(3, 151936).to(dtype), torch.zeros(3, dtype=torch.long), torch.zeros(3)
    head_kernel.chunk_forward(raw, targets, 1.0, entropy, block=block)
    head_kernel.chunk_grad_logits(raw, targets, rows, rows, rows if entropy else None, 1.0, rows if entropy else None,
                                  block=block // 2)
    assert len(_compile(forward)) == 1 and len(_compile(gradient)) == 1


def test_a_failing_loss_head_kernel_says_how_to_run_without_it(monkeypatch):
    """A launch or compiler failure of the head's kernels is a CompileError naming the kernel and the switch that turns
    compiled chunks off (as every compiled part of treerl says), not Triton's raw exception."""
    from treerl.compiled import CompileError
    from treerl.engine import head_kernel

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("PassManager::run failed\n(details)")
            return launch

    monkeypatch.setattr(head_kernel, "_grad_kernel", Failing())
    raw, rows = torch.randn(2, 64), torch.zeros(2)
    with pytest.raises(CompileError, match=r"Triton gradient kernel failed: PassManager::run failed; .*compile=False"):
        head_kernel.chunk_grad_logits(raw, torch.zeros(2, dtype=torch.long), rows, rows, None, 1.0, None)

    class OutOfMemory:  # the device's own error is not the kernel's: it passes as it is
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise torch.OutOfMemoryError("CUDA out of memory")
            return launch

    monkeypatch.setattr(head_kernel, "_lse_kernel", OutOfMemory())
    with pytest.raises(torch.OutOfMemoryError):
        head_kernel.chunk_forward(raw, torch.zeros(2, dtype=torch.long), 1.0, False)
