"""The decode step's block tail against the modules' tail in float64: one case both tail tests build
(``tests/rollout/test_small_products.py``, ``tests/rollout/test_silu_gate.py``)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from helpers.models import tiny_model
from treerl.models import rmsnorm_in_input_precision
from treerl.rollout.blocks import FusedProjections
from treerl.rollout.layer_math import _tail_norm


def float64_tail_case(family: str, extra: dict, rows: int, device: str) -> SimpleNamespace:
    """A float32 tiny ``family`` model (hidden 128, MLP 256; ``extra`` config fields; a bias of the output projection
    drawn at random when the config has one) on ``device``: its first ``layer``, ``fused`` projections, seeded
    ``hidden [rows, 1, 128]`` and attention output ``attn``, the ``following`` norm, and ``want``: ``_tail_norm`` of
    a float64 copy of the model on the same inputs."""
    model = tiny_model(family, dtype=torch.float32, seed=5, hidden_size=128, intermediate_size=256, **extra).to(device)
    if extra.get("attention_bias"):  # (random biases: the initialisation's are zero)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.bias.normal_()
    ref = rmsnorm_in_input_precision(copy.deepcopy(model).double())
    layer, ref_layer = model.model.layers[0], ref.model.layers[0]
    f, fr = FusedProjections(model.model.layers), FusedProjections(ref.model.layers)
    g = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(rows, 1, 128, device=device, generator=g)
    attn = torch.randn(rows, 1, layer.self_attn.o_proj.in_features, device=device, generator=g)
    following, ref_following = model.model.layers[1].input_layernorm, ref.model.layers[1].input_layernorm
    want = _tail_norm(ref_layer, hidden.double(), attn.double(), fr.gate_up_w[0], fr.gate_up_b[0], fr.o_w[0],
                      fr.down_w[0], ref_following)
    return SimpleNamespace(layer=layer, fused=f, hidden=hidden, attn=attn, following=following, want=want)
