"""The decode step's SiLU gate kernel (:mod:`treerl.rollout.silu_gate`) against float64 and the modules' rounding,
and the block's tail through it (``layer_math._gated_tail``) against the modules' tail in float64. On a GPU, or on
the CPU with ``TRITON_INTERPRET=1`` (every CI run takes it that way through
``tests/rollout/test_kernels_interpreted.py``); ``tests/cuda/test_rollout_cuda.py`` has the bf16 cases and the
engine's steps through it. (The CPU cases are float16 and float32: Triton 3.6's interpreter truncates float32 ->
bf16 casts instead of rounding them to nearest, so bf16 cannot be checked bit for bit there.)"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from helpers.models import tiny_model
from helpers.tails import float64_tail_case
from treerl.rollout import silu_gate as sg
from treerl.rollout import layer_math
from treerl.rollout.blocks import DecodeBlocks
from treerl.rollout.layer_math import _dense_silu, _gated_tail, _tail_back, _tail_front

pytestmark = pytest.mark.skipif(
    sg.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, inner", [(1, 8), (5, 1000), (3, 2500)])  # (a partial block; several blocks a row)
def test_silu_gate_equals_float64_and_the_modules_rounding(dtype, rows, inner):
    """``silu(gate) * up`` against float64 (to the two roundings: 2 units of the dtype's last place of the largest
    value; float32: 1e-6) and against torch's ``F.silu(gate) * up`` in the dtype (the modules' eager math: the same
    roundings, up to the exponential's and the division's last bits: 1 unit of the largest value; in 16 bits
    equal but for at most one element in a thousand, which a kernel without silu's rounding to the dtype is not:
    ~27% differ)."""
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inner, device=DEVICE, generator=g) * 3).to(dtype)
    got = sg.silu_gate(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    eps = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert got.shape == (rows, inner) and got.dtype == dtype
    assert (got.double() - want).abs().max() <= eps * want.abs().max()
    gate, up = gate_up.chunk(2, dim=-1)
    eager = torch.nn.functional.silu(gate) * up
    assert (got.double() - eager.double()).abs().max() <= torch.finfo(dtype).eps * eager.double().abs().max()
    if dtype != torch.float32:
        assert int((got != eager).sum()) <= 1 + got.numel() // 1000, int((got != eager).sum())


def test_silu_gate_reads_rows_through_their_stride():
    """A view of wider rows (the gate/up output inside a larger buffer) reads each row from its own start."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    buf = torch.randn(4, 40, device=DEVICE, generator=g)
    view = buf[:, :32]
    assert not view.is_contiguous()
    assert torch.allclose(sg.silu_gate(view), sg.silu_gate(view.contiguous()), rtol=0, atol=0)


def test_silu_gate_refuses_what_it_would_misread():
    """An odd width, a float64 or a 3-d input, or columns apart: a ValueError naming the input (``runs_here``
    False for each)."""
    for bad in (torch.zeros(2, 7, device=DEVICE), torch.zeros(2, 8, device=DEVICE, dtype=torch.float64),
                torch.zeros(2, 1, 8, device=DEVICE), torch.zeros(8, 2, device=DEVICE).T):
        assert not sg.runs_here(bad)
        with pytest.raises(ValueError, match="silu_gate"):
            sg.silu_gate(bad)
    assert sg.silu_gate(torch.zeros(0, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.parametrize("family, extra", [("qwen3", {}), ("llama", dict(attention_bias=True, mlp_bias=False))],
                         ids=["qwen3", "llama-output-bias"])
def test_gated_tail_equals_the_modules_tail_in_float64(family, extra):
    """The block tail with the SiLU gate kernel between its two halves against ``_tail_norm`` of a float64 copy of
    the model (float32: 2e-5 of the largest value), with an output projection's bias."""
    case = float64_tail_case(family, extra, 6, DEVICE)
    f = case.fused
    assert _dense_silu(case.layer, f, 0)
    got = _gated_tail(_tail_front, _tail_back, case.layer, case.hidden, case.attn, f.gate_up_w[0], f.o_w[0],
                      f.down_w[0], case.following)
    for a, b in zip(case.want, got):
        assert a.shape == b.shape and (b.double() - a).abs().max() <= 2e-5 * a.abs().max(), (a - b.double()).abs().max()


def test_the_step_takes_it_for_dense_silu_layers_only():
    """``DecodeBlocks._gated``: admitted (after its probe) for a Qwen3's dense SiLU MLPs; refused where a layer's
    activation is not SiLU, or in float64 (the kernel takes 16-bit and float32)."""
    model = tiny_model("qwen3", dtype=torch.float32, seed=5, hidden_size=64, intermediate_size=192).to(DEVICE)
    hidden = torch.randn(3, 1, 64, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(2))
    blocks = DecodeBlocks(model, compile=False)
    assert blocks._gated(hidden) and blocks.gated
    assert not DecodeBlocks(copy.deepcopy(model).double(), compile=False)._gated(hidden.double())
    gelu = copy.deepcopy(model)
    gelu.model.layers[1].mlp.act_fn = torch.nn.GELU()
    assert not DecodeBlocks(gelu, compile=False)._gated(hidden)


def test_a_gate_kernel_that_disagrees_is_refused_once_with_a_warning(monkeypatch):
    """``DecodeBlocks._gated`` with a wrong ``silu_gate`` (the up half alone): False, one warning naming the kernel
    and the fallback, and no second probe at the next step."""
    monkeypatch.setattr(layer_math, "silu_gate", lambda gu: gu[:, gu.shape[1] // 2:].contiguous())
    model = tiny_model("qwen3", dtype=torch.float32, seed=5, hidden_size=64, intermediate_size=192).to(DEVICE)
    hidden = torch.randn(3, 1, 64, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(3))
    blocks = DecodeBlocks(model, compile=False)
    with pytest.warns(UserWarning, match="SiLU gate kernel disagreed .* one piece"):
        assert not blocks._gated(hidden)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not blocks._gated(hidden) and blocks.gated is False


def test_the_kernel_step_through_the_gate_matches_the_torch_step(monkeypatch):
    """The split-key kernel step with the small-row kernels off (``MAX_ROWS = 0``: every step's tail through the
    gate kernel between its halves) on the CPU in float32 (Triton's interpreter): the torch step's greedy tokens
    and logprobs to 1e-5, the gate kernel in every layer of every step after the first."""
    import treerl.rollout.blocks as blocks
    from helpers.rollout import random_prompts
    from treerl.rollout import RolloutEngine, SamplingParams, small_products
    from treerl.rollout.shared import SharedPrefixCache

    if DEVICE == "cuda":
        pytest.skip("on CUDA: tests/cuda/test_rollout_cuda.py::test_cuda_small_products_in_the_engine")
    model = tiny_model("qwen3", dtype=torch.float32, seed=2, head_dim=16)
    prompts = random_prompts([9, 3], seed=6)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=5, seed=0)
    want = RolloutEngine(model, sync_every=4).generate(prompts, params)
    monkeypatch.setattr(SharedPrefixCache, "backend", lambda self, own_len, prefix_len: "split")
    monkeypatch.setattr(blocks, "merged_attention_ok", lambda *a: True)  # (its probe needs CUDA)
    monkeypatch.setattr(small_products, "MAX_ROWS", 0)
    gates = []
    gate = layer_math.silu_gate
    monkeypatch.setattr(layer_math, "silu_gate", lambda gu: gates.append(1) or gate(gu))
    engine = RolloutEngine(model, sync_every=4)
    got = engine.generate(prompts, params)
    assert engine.decode_blocks.gated and not engine.decode_blocks.small
    assert len(gates) == 1 + 4 * len(model.model.layers)  # (the probe, then 4 decode steps of every layer)
    for a, b in zip(want, got):
        for x, y in zip(a, b):
            assert x.completion_ids.tolist() == y.completion_ids.tolist()
            assert torch.allclose(x.logprobs, y.logprobs, atol=1e-5)
