"""Float8 K/V stores on the GPU (``RolloutEngine(kv_cache_dtype="fp8")``): the split-key
attention kernels reading float8 pools, the K/V copy kernel converting into and out of them,
the fused RoPE kernel writing them, and the engine's completions against the float64
rounded-K/V reference (tests/rollout/test_rollout_kv_fp8.py, their CPU counterparts).
Skipped without a GPU."""

import copy

import pytest
import torch

from helpers.fp8 import FP8, fp8_completion_logprobs
from helpers.models import tiny_model
from helpers.rollout import random_prompts
from treerl.models import rmsnorm_in_input_precision
from treerl.rollout import RolloutEngine, SamplingParams
from treerl.rollout.types import stored

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _attention_f64(q, k, v, mask, scale):
    s = q.double() @ k.double().transpose(-1, -2) * scale + mask.double().reshape(mask.shape[0], 1, 1, -1)
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_split_attention_reads_float8_pools(dtype):
    """Paged float8 K/V (rows of unequal visible lengths), bf16/fp16 queries: the split kernel in
    key ranges, merged by LSE, and the merged kernel equal float64 attention over the same
    float8 values widened (2e-2, the half-precision probe's tolerance); the probes pass."""
    from treerl.rollout.decode_attention import split_attention, split_attention_ok, to_pages
    from treerl.rollout.shared import merge_parts, merged_attention_ok

    assert split_attention_ok("cuda", dtype, 128, 128, 64, FP8) and merged_attention_ok("cuda", dtype, 128, 128, FP8)
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, M, N = 6, 2, 2, 448
    q = torch.randn(B, H, M, 128, device="cuda", dtype=dtype, generator=g)
    k = (torch.randn(B, H, N, 128, device="cuda", generator=g) * 3).to(FP8)
    v = (torch.randn(B, H, N, 128, device="cuda", generator=g) * 3).to(FP8)
    mask = torch.zeros(B, N, device="cuda", dtype=dtype)
    for r, n in enumerate((448, 1, 100, 300, 65, 447)):
        mask[r, n:] = torch.finfo(dtype).min
    want, want_lse = _attention_f64(q, k, v, mask, 128 ** -0.5)
    pk, pv, table = to_pages(k, v, 64, g)
    out, lse = split_attention(q, pk, pv, mask, 128 ** -0.5, splits=4, table=table)
    got = (torch.softmax(lse.double(), 2)[..., None] * out.double()).sum(2)
    assert torch.allclose(got, want, atol=2e-2) and torch.allclose(torch.logsumexp(lse.double(), 2), want_lse, atol=2e-2)
    o_pre = torch.zeros(B // 3, H, 1, 3 * M, 128, device="cuda")
    l_pre = torch.full((B // 3, H, 1, 3 * M), float("-inf"), device="cuda")
    from treerl.rollout.decode_attention import split_attention_merged
    merged = split_attention_merged(q, pk, pv, mask, 128 ** -0.5, o_pre, l_pre, 3, dtype, table=table)
    ref = merge_parts(want.unsqueeze(2), want_lse.unsqueeze(2), o_pre.double(), l_pre.double(), 3, torch.float64)
    assert torch.allclose(merged.double(), ref, atol=2e-2), (merged.double() - ref).abs().max()


def test_cuda_copy_slots_converts_into_and_out_of_float8():
    """bf16 dense -> float8 paged: each value as ``Tensor.to`` rounds it (saturated at 448);
    float8 -> bf16 dense: widened exactly."""
    from treerl.rollout.kv_copy import copy_slots, copy_slots_ok

    assert copy_slots_ok("cuda", torch.bfloat16, 128, FP8) and copy_slots_ok("cuda", FP8, 128, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    L, H, D, page = 2, 2, 128, 16
    dense = (torch.randn(L, 3, H, 50, D, device="cuda", generator=g) * 200).to(torch.bfloat16)
    pool = torch.zeros(L, 9, H, page, D, device="cuda", dtype=FP8)
    table = torch.tensor([[4, 1, 7, 8], [0, 2, 3, 8]], device="cuda")
    i64 = lambda *a: torch.tensor(a, device="cuda")  # noqa: E731
    copy_slots(dense, pool, i64(2, 0), i64(3, 0), i64(0, 1), i64(0, 0), i64(47, 50), 50, dst_table=table)
    back = torch.zeros(L, 2, H, 50, D, device="cuda", dtype=torch.bfloat16)
    copy_slots(pool, back, i64(0, 1), i64(0, 0), i64(0, 1), i64(0, 0), i64(47, 50), 50, src_table=table)
    rounded = stored(dense, FP8).to(torch.bfloat16)  # (saturated: torch's CUDA cast alone gives NaN past 448)
    assert torch.equal(back[:, 0, :, :47], rounded[:, 2, :, 3:50]) and torch.equal(back[:, 1], rounded[:, 0])
    assert rounded.abs().max() == 448


@pytest.mark.parametrize("hf_path", [False, True], ids=["kernel-step", "hf-forward"])
def test_cuda_fp8_engine_matches_the_rounded_reference(hf_path):
    """A float32 model on the GPU with float8 K/V (served rows and groups of 3): the kernel step
    (split, rope and copy kernels on float8 pools, CUDA graphs) or the model's forward (eager,
    the stores' indexing paths) against the float64 rounded-K/V reference. Float32 K/V rounds to
    float8 like float64's except at a rare tie, so: 2e-4 for 95% of tokens, 5e-2 for all."""
    model = tiny_model(dtype=torch.float32, seed=4).cuda()
    reference = rmsnorm_in_input_precision(copy.deepcopy(model).cpu().double())
    kw = dict(cuda_graphs=False, compile_decode=False) if hf_path else {}
    engine = RolloutEngine(model, kv_cache_dtype="fp8", kv_block_size=16, **kw)
    if hf_path:
        engine.decode_blocks = None
    prompts = random_prompts([5, 40, 23], seed=3)
    diffs = []
    for n in (1, 3):
        for prompt, group in zip(prompts, engine.generate(prompts, SamplingParams(n=n, max_new_tokens=24, seed=n))):
            for c in group:
                want = fp8_completion_logprobs(reference, prompt, c.completion_ids.tolist())
                diffs.append((c.logprobs.double().cpu() - want).abs())
    diffs = torch.cat(diffs)
    assert (diffs <= 2e-4).float().mean() >= 0.95 and diffs.max() <= 5e-2, (diffs.max(), (diffs > 2e-4).sum())
    if not hf_path:
        assert engine.decode_blocks.rope_kernel
