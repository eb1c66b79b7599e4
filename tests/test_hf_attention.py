"""treerl.hf_attention: the one Hugging Face attention hook. Inside the block every
attention module of the model calls the registered function (every config the model holds
switched), and everything is restored on leaving, nested or after an error."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from treerl.hf_attention import attention_routed, register
from treerl.models import build_model


def test_routes_every_attention_call_and_restores(gen):
    model = build_model("qwen3", "tiny", dtype=torch.float64)
    # a module holding a config of its own (as composite models do) is switched too
    own = type(model.config).from_dict(model.config.to_dict())
    own._attn_implementation = model.config._attn_implementation
    model.model.layers[1].self_attn.config = own
    seen = []

    def counting(module, *args, **kwargs):
        seen.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    register("test_counting", counting)
    ids = torch.randint(0, 512, (1, 7), generator=gen)
    before = model(ids).logits
    assert seen == []
    with attention_routed(model, "test_counting"):
        assert model.config._attn_implementation == own._attn_implementation == "test_counting"
        routed = model(ids).logits
        with attention_routed(model.model, "sdpa"):  # nested: the inner one wins, then ours again
            model(ids)
        assert model.config._attn_implementation == "test_counting"
    assert seen == [0, 1]  # each layer once: the nested call went through sdpa
    torch.testing.assert_close(routed, before, rtol=1e-12, atol=1e-12)
    assert model.config._attn_implementation == own._attn_implementation != "test_counting"
    with pytest.raises(RuntimeError, match="boom"), attention_routed(model, "test_counting"):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == own._attn_implementation != "test_counting"
