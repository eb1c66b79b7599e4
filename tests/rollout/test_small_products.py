"""The decode step's small-row product kernels (:mod:`treerl.rollout.small_products`) against float64
products, and the block's tail through them (``layer_math._small_tail``) against the modules' tail in
float64. On a GPU, or on the CPU with ``TRITON_INTERPRET=1`` (every CI run takes it that way through
``tests/rollout/test_kernels_interpreted.py``); ``tests/cuda/test_rollout_cuda.py`` has the bf16 cases
and the engine's step through them."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from helpers.models import tiny_model
from helpers.tails import float64_tail_case
from treerl.models import rmsnorm_in_input_precision
from treerl.rollout import small_products
from treerl.rollout.blocks import FusedProjections
from treerl.rollout.layer_math import _residual_norm, _small_layer, _small_tail

pytestmark = pytest.mark.skipif(
    small_products.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative to the largest value: float32, sums over K in another order; float16, the roundings of the gated product
TOL = {torch.float32: 2e-5, torch.float16: 4 * torch.finfo(torch.float16).eps}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool((got.double() - want).abs().max() <= TOL[dtype] * want.abs().max())


@pytest.fixture(params=[True, False], ids=["tma", "pointers"])
def tma(request, monkeypatch):
    """The products' tiles through tensor descriptors (sm_90+ and the interpreter) or per-thread addresses."""
    if request.param and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors: sm_90+ (this GPU runs the pointer kernels)")
    monkeypatch.setattr(small_products, "TMA", request.param)
    return request.param


def test_tiles_the_descriptors_cannot_take_go_through_addresses():
    """A misaligned input or rows closer than a row apart (an expanded view) run the pointer kernels, and their
    products still equal float64's."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    buf = torch.randn(64, 257, device=DEVICE, generator=g).half()
    w = (torch.randn(64, 256, device=DEVICE, generator=g) / 16).half()
    aligned, shifted = buf[:, :256], buf[:, 1:257]  # (the second starts 2 bytes in: not 16-byte aligned)
    expanded = buf[:1, :256].expand(8, 256)  # (row stride 0)
    assert small_products._tma(aligned.contiguous(), w)
    assert not small_products._tma(shifted, w) and not small_products._tma(expanded, w)
    for x in (shifted, expanded):
        want = x.double() @ w.double().T
        assert _close(small_products.linear_partials(x, w).sum(0), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64, 100])
def test_products_equal_float64(dtype, rows, tma):
    """``linear_partials`` (each number of K ranges; their sum) and ``gated`` against float64 products,
    with a column count that leaves a partial tile and K tiles of 128, 64 and 32, their tiles read through
    tensor descriptors (``tma``) or per-thread addresses."""
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    for K in (256, 96):
        x = torch.randn(rows, K, device=DEVICE, generator=g).to(dtype)
        w = (torch.randn(88, K, device=DEVICE, generator=g) / K ** 0.5).to(dtype)
        ref = x.double() @ w.double().T
        for splits in (None, 1, 2):
            parts = small_products.linear_partials(x, w, splits=splits)
            assert parts.dtype == torch.float32 and parts.shape[1:] == (rows, 88)
            assert splits is None or parts.shape[0] == splits
            assert _close(parts.sum(0), ref, torch.float32)
        gate, up = ref[:, :44], ref[:, 44:]
        assert _close(small_products.gated(x, w), torch.nn.functional.silu(gate) * up, dtype)


def test_splits_reach_the_programs_in_whole_tiles():
    assert small_products.splits_for(1024, 2048, 32) == 4  # 32 column tiles x 4 ranges = 128 programs
    assert small_products.splits_for(4096, 1024, 32) == 1  # already 128 column tiles
    assert small_products.splits_for(1024, 3072, 32) == 4  # 3072 = 4 x 768 = 4 x 6 tiles of 128
    assert small_products.splits_for(1024, 384, 32) == 1  # 384 = 3 tiles of 128: no whole halves
    assert small_products.splits_for(8, 4096, 32) == small_products.SPLITS_MAX


def test_runs_here_refuses_what_the_kernels_do_not_take():
    x = torch.zeros(4, 64, device=DEVICE)
    w = torch.zeros(32, 64, device=DEVICE)
    assert small_products.runs_here(x, w)
    assert not small_products.runs_here(x.double(), w.double())  # (float64: torch's products)
    assert not small_products.runs_here(torch.zeros(small_products.MAX_ROWS + 1, 64, device=DEVICE), w)
    assert not small_products.runs_here(x, torch.zeros(32, 72, device=DEVICE))
    assert small_products.runs_here(x, w, torch.zeros(32, 96, device=DEVICE))  # (each product its own inner size)
    assert not small_products.runs_here(x, w.half())
    assert not small_products.runs_here(x, torch.zeros(64, 32, device=DEVICE).t())  # (columns not contiguous)
    with pytest.raises(ValueError, match="not a multiple"):
        small_products.gated(torch.zeros(4, 72, device=DEVICE), torch.zeros(32, 72, device=DEVICE))
    with pytest.raises(ValueError, match="equal ranges"):
        small_products.linear_partials(torch.zeros(4, 96, device=DEVICE), torch.zeros(32, 96, device=DEVICE), splits=5)


@pytest.mark.parametrize("family, extra", [("qwen3", {}), ("llama", {}), ("llama", dict(attention_bias=True))],
                         ids=["qwen3", "llama", "llama-output-bias"])
def test_small_tail_equals_the_modules_tail_in_float64(family, extra, tma):
    """The block tail with the small products (output partials summed in the residual + norm, gate/up
    and SiLU in one kernel, down partials in the next residual + norm) against ``_tail_norm`` of a
    float64 copy of the model; with an output projection's bias (added to the partials' sum before its
    rounding, as ``F.linear`` adds it)."""
    case = float64_tail_case(family, extra, 5, DEVICE)
    weights = _small_layer(case.layer, case.fused, 0)
    assert weights is not None
    got = _small_tail(_residual_norm, case.layer, case.hidden, case.attn, weights, case.following)
    for a, b in zip(case.want, got):
        assert a.shape == b.shape and _close(b, a, torch.float32), (a - b.double()).abs().max()


def test_small_layer_refuses_what_runs_as_a_module():
    """A hooked output projection runs as its module (its hook sees the call); a sparse or biased
    gate/up, or another activation, leaves the layer to the modules' tail."""
    model = tiny_model("qwen3", dtype=torch.float32, seed=5)
    layer = model.model.layers[0]
    f = FusedProjections(model.model.layers)
    assert _small_layer(layer, f, 0) is not None
    handle = layer.self_attn.o_proj.register_forward_hook(lambda *a: None)
    assert _small_layer(layer, f, 0) is None
    handle.remove()
    for module in (layer.mlp.down_proj, layer.mlp.act_fn):
        handle = module.register_forward_pre_hook(lambda *a: None)
        assert _small_layer(layer, f, 0) is None
        handle.remove()
    assert _small_layer(layer, f, 0) is not None
    layer.mlp.act_fn = torch.nn.GELU()
    assert _small_layer(layer, f, 0) is None
    biased = tiny_model("llama", dtype=torch.float32, seed=5, mlp_bias=True)  # (a gate/up bias: the modules' tail)
    assert _small_layer(biased.model.layers[0], FusedProjections(biased.model.layers), 0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits, bias", [(1, False), (4, True)])
def test_residual_norm_equals_the_residual_and_the_modules_norm(dtype, splits, bias):
    """``residual_norm`` (the partials' sum, the bias, the residual and an RMSNorm in one kernel) against
    ``layer_math._residual_norm`` of a float64 copy (the modules' norm) and of the same dtype, on a hidden size that
    leaves a partial tile; the norm's weight random."""
    model = tiny_model("qwen3", dtype=torch.float32, seed=5, hidden_size=96, num_attention_heads=4, head_dim=24)
    norm = model.model.layers[0].post_attention_layernorm.to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(splits)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, device=DEVICE, generator=g))
    norm = norm.to(dtype)
    hidden = torch.randn(7, 1, 96, device=DEVICE, generator=g).to(dtype)
    partials = torch.randn(splits, 7, 96, device=DEVICE, generator=g)
    b = torch.randn(96, device=DEVICE, generator=g).to(dtype) if bias else None
    got = small_products.residual_norm(hidden, partials, b, norm)
    ref_norm = rmsnorm_in_input_precision(copy.deepcopy(norm).double())
    want = _residual_norm(hidden.double(), ref_norm, None if b is None else b.double(), *partials.double().unbind(0))
    same = _residual_norm(hidden, norm, b, *partials.unbind(0))
    for g_, w_, s_ in zip(got, want, same):
        assert g_.shape == w_.shape and g_.dtype == dtype
        assert _close(g_, w_, dtype) and _close(g_, s_.double(), dtype)


def test_residual_norm_takes_plain_rmsnorms_only():
    """``plain_rmsnorm``: Qwen3's and Llama's RMSNorm (and the float64 fix of their forward) in the hidden's
    dtype; not a hooked one, one whose weight is in another dtype, or a LayerNorm, which ``residual_norm``
    refuses."""
    qwen, llama = (tiny_model(f, dtype=torch.float32, seed=5).model.layers[0].input_layernorm for f in ("qwen3", "llama"))
    hidden = torch.zeros(2, 1, qwen.weight.shape[0])
    assert small_products.plain_rmsnorm(qwen, hidden) and small_products.plain_rmsnorm(llama, hidden)
    assert small_products.plain_rmsnorm(rmsnorm_in_input_precision(copy.deepcopy(qwen)), hidden)
    assert not small_products.plain_rmsnorm(qwen, hidden.half())
    handle = qwen.register_forward_hook(lambda *a: None)
    assert not small_products.plain_rmsnorm(qwen, hidden)
    handle.remove()
    layer_norm = torch.nn.LayerNorm(hidden.shape[-1])
    assert not small_products.plain_rmsnorm(layer_norm, hidden)
    with pytest.raises(ValueError, match="plain RMSNorm"):
        small_products.residual_norm(hidden, torch.zeros(1, 2, hidden.shape[-1]), None, layer_norm)


def test_the_kernels_refuse_inputs_they_would_misread():
    x, w = torch.zeros(4, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE)
    for bad_x, bad_w, match in ((torch.zeros(4, 128, device=DEVICE)[:, ::2], w, "contiguous"),
                                (x, torch.zeros(32, 48, device=DEVICE), "one dtype"),
                                (x, w.half(), "one dtype")):
        for fn in (small_products.linear_partials, small_products.gated):
            with pytest.raises(ValueError, match=match):
                fn(bad_x, bad_w)
    with pytest.raises(ValueError, match="up rows"):
        small_products.gated(x, torch.zeros(33, 64, device=DEVICE))


def test_the_step_takes_them_where_the_attention_width_differs_from_the_hidden_size():
    """``DecodeBlocks._small_weights``: every layer's weights where the output projection's inner size
    (heads x head size) and the MLP's differ from the hidden size, after the probe agreed; none above
    ``MAX_ROWS`` rows or in float64."""
    from treerl.rollout.blocks import DecodeBlocks

    model = tiny_model("qwen3", dtype=torch.float32, seed=5, hidden_size=64, intermediate_size=192,
                       num_attention_heads=8, head_dim=16).to(DEVICE)
    blocks = DecodeBlocks(model, compile=False)
    hidden = torch.randn(3, 1, 64, device=DEVICE)
    weights = blocks._small_weights(hidden)
    assert blocks.small and weights is not None and len(weights) == len(model.model.layers)
    assert weights[0][0].shape == (64, 128) and weights[0][3].shape == (64, 192)
    assert blocks._small_weights(torch.randn(small_products.MAX_ROWS + 1, 1, 64, device=DEVICE)) is None
    assert DecodeBlocks(model.double(), compile=False)._small_weights(hidden.double()) is None
