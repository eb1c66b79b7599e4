"""The decode step's Q/K norm + RoPE + K/V write kernel (:mod:`treerl.rollout.rope_kernel`) against
the modules' math (``layer_math._pre``) in float64: queries in both layouts, the token's K/V and the
pools' slots; query heads per KV head a power of two or not (a masked tile). On a GPU, or on the
CPU with ``TRITON_INTERPRET=1`` (every CI run takes it that way through
``tests/rollout/test_kernels_interpreted.py``); ``tests/cuda/test_rollout_cuda.py`` has the bf16 case."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from helpers.models import tiny_model
from treerl.models import rmsnorm_in_input_precision
from treerl.rollout import rope_kernel, small_products
from treerl.rollout.blocks import FusedProjections
from treerl.rollout.layer_math import _heads, _pre, _qk_norms, _qkv

pytestmark = pytest.mark.skipif(
    rope_kernel.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family, heads, kv_heads", [("qwen3", 4, 2), ("qwen3", 6, 2), ("llama", 4, 4),
                                                     ("llama", 8, 2)])
def test_rope_write_matches_the_modules_in_float64(family, heads, kv_heads):
    model = tiny_model(family, dtype=torch.float32, seed=3, head_dim=64, num_attention_heads=heads,
                       num_key_value_heads=kv_heads).to(DEVICE)
    ref = rmsnorm_in_input_precision(copy.deepcopy(model).double())
    base, B, G = model.model, 6, 3
    gen = torch.Generator(device=DEVICE).manual_seed(heads)
    hidden = torch.randn(B, 1, model.config.hidden_size, device=DEVICE, generator=gen)
    cos, sin = base.rotary_emb(hidden, torch.randint(0, 4000, (B, 1), device=DEVICE, generator=gen))
    block = torch.randperm(B, device=DEVICE, generator=gen)
    offset = torch.randint(0, 16, (B,), device=DEVICE, generator=gen)
    f, fr = FusedProjections(base.layers), FusedProjections(ref.model.layers)
    layer = base.layers[0]
    pools = [torch.zeros(B, kv_heads, 16, 64, device=DEVICE) for _ in range(2)]
    want_pools = [p.double() for p in pools]
    want = _pre(ref.model.layers[0], hidden.double(), cos.double(), sin.double(), G, fr.qkv_w[0], fr.qkv_b[0],
                *want_pools, block, offset)
    got = rope_kernel.rope_write(_qkv(layer, hidden, f.qkv_w[0], f.qkv_b[0]), cos, sin, *_qk_norms(layer),
                                 *_heads(layer), G, *pools, block, offset)
    for name, a, b in zip(("q_own", "q_pre", "k", "v", "k pool", "v pool"), list(want) + want_pools, list(got) + pools):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.allclose(b.double(), a, atol=1e-5 * a.abs().max().item()), (name, (a - b.double()).abs().max())


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_rope_write_sums_the_products_partials(splits):
    """As a link of the small-row chain the kernel takes the Q/K/V product as its float32 partial sums
    (``small_products.linear_partials``) and adds them up: float32 against the modules' math in float64, and
    bf16 (the sum rounded to bf16, as the product's output is; partials summed by torch) against the kernel
    on the product itself, within two units of bf16's last place."""
    model = tiny_model("qwen3", dtype=torch.float32, seed=5, head_dim=64, num_attention_heads=4,
                       num_key_value_heads=2).to(DEVICE)
    ref = rmsnorm_in_input_precision(copy.deepcopy(model).double())
    base, B, G = model.model, 8, 4
    gen = torch.Generator(device=DEVICE).manual_seed(splits)
    hidden = torch.randn(B, 1, model.config.hidden_size, device=DEVICE, generator=gen)
    cos, sin = base.rotary_emb(hidden, torch.randint(0, 4000, (B, 1), device=DEVICE, generator=gen))
    block, offset = torch.randperm(B, device=DEVICE, generator=gen), torch.randint(0, 16, (B,), device=DEVICE,
                                                                                    generator=gen)
    f, fr, layer = FusedProjections(base.layers), FusedProjections(ref.model.layers), base.layers[0]
    pools = [torch.zeros(B, 2, 16, 64, device=DEVICE) for _ in range(2)]
    want_pools = [p.double() for p in pools]
    want = _pre(ref.model.layers[0], hidden.double(), cos.double(), sin.double(), G, fr.qkv_w[0], None,
                *want_pools, block, offset)
    x = layer.input_layernorm(hidden).reshape(B, -1)  # (the product's input: _qkv's)
    partials = small_products.linear_partials(x, f.qkv_w[0], splits=splits)
    assert partials.shape[0] == splits
    got = rope_kernel.rope_write(partials, cos, sin, *_qk_norms(layer), *_heads(layer), G, *pools, block, offset,
                                 dtype=torch.float32)
    for a, b in zip(list(want) + want_pools, list(got) + pools):
        assert a.shape == b.shape and torch.allclose(b.double(), a, atol=1e-5 * a.abs().max().item()), (a - b).abs().max()
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    layer16, f16, x16 = model16.model.layers[0], FusedProjections(model16.model.layers), hidden.to(torch.bfloat16)
    cos16, sin16 = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    runs = []
    normed16 = layer16.input_layernorm(x16).reshape(B, -1)
    w16, K = f16.qkv_w[0], normed16.shape[1]  # (the partials by torch: the interpreter's bf16 products are not exact)
    by_torch = torch.stack([normed16[:, k:k + K // splits].float() @ w16[:, k:k + K // splits].float().T
                            for k in range(0, K, K // splits)])
    for qkv, kw in ((by_torch,
                     dict(dtype=torch.bfloat16)), (_qkv(layer16, x16, f16.qkv_w[0], None), {})):
        p16 = [torch.zeros(B, 2, 16, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
        runs.append(list(rope_kernel.rope_write(qkv, cos16, sin16, *_qk_norms(layer16), *_heads(layer16), G, *p16,
                                                block, offset, **kw)) + p16)
    for a, b in zip(*runs):
        assert a.dtype == b.dtype == torch.bfloat16
        tol = 2 * torch.finfo(torch.bfloat16).eps * b.float().abs().max().item()
        assert torch.allclose(a.float(), b.float(), rtol=2 * torch.finfo(torch.bfloat16).eps, atol=tol)
