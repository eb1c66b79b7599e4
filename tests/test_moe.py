"""Qwen3-MoE through the whole system: every engine mode against an independent
per-sequence Hugging Face forward (float64, 1e-9: logprobs, entropies and every
parameter's gradient, router and experts included), the grouped expert GEMMs against
their fallback, the rollout's greedy output against full forwards, the memory model's
expert terms, and a saved MoE model directory loading through treerl."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from helpers.configs import run_config
from helpers.forests import RandomLoss, SMALL_MODE_KW, SMALL_SPEC, shaped_forest
from helpers.models import VOCAB, tiny_model
from helpers.reference import (FLOOR, TOL, assert_grads_close, assert_seq_close, grads_of, reference_logprobs,
                               reference_step, zero_grads)
from helpers.rollout import greedy_reference, random_prompts, sampling
from treerl import TreeEngine, moe
from treerl.models import load_model, runs_own_loop
from treerl.rollout import RolloutEngine

SPEC, MODE_KW = SMALL_SPEC, SMALL_MODE_KW


MOE = dict(shape="tiny-moe", precise_norm=True)  # tiny_model("qwen3_moe", dtype, randomise=seed, **MOE, ...)


def _hf_router_forward(self, hidden_states):
    """HF's Qwen3MoeTopKRouter.forward with the softmax in the input precision (HF: float32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.promote_types(router_logits.dtype, torch.float32))
    top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), top_index


def hf_reference(model):
    """An independent copy: Hugging Face's own sparse block and its per-expert loop
    (``experts_implementation="eager"``), only the router's softmax precision fixed."""
    ref = copy.deepcopy(model)
    for module in ref.modules():
        if moe.is_moe_block(module):
            del module.forward  # back to HF's Qwen3MoeSparseMoeBlock.forward
            module.gate.forward = types.MethodType(_hf_router_forward, module.gate)
    ref.set_experts_implementation("eager")
    return ref


@pytest.mark.parametrize("mode", ["flat", "packed", "dfs", "auto"])
def test_every_mode_equals_the_hf_reference(mode, gen):
    model = tiny_model("qwen3_moe", randomise=int(torch.randint(0, 1000, (1,), generator=gen)), vocab_size=VOCAB, **MOE)
    assert runs_own_loop(model) and moe.is_moe_model(model)
    ref = hf_reference(model)
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen, coupled=True)
    ref_loss, ref_grads, ref_lps, ref_ents = reference_step(ref, seqs, loss, entropy=True)
    engine = TreeEngine(model, mode, **MODE_KW[mode])
    assert engine.runner.stack.own_loop
    lps, ents = engine.logprobs(seqs, entropy=True)
    assert_seq_close(lps, ref_lps, TOL[torch.float64])
    assert_seq_close(ents, ref_ents, TOL[torch.float64], "entropies")
    zero_grads(model)
    value = engine.forward_backward(seqs, loss, entropy=True)
    assert value == pytest.approx(ref_loss, rel=1e-9, abs=1e-9)
    grads = grads_of(model)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
                 "model.layers.1.mlp.experts.down_proj"):
        assert grads[name].abs().max() > 0, name  # the router and the experts are trained
    assert_grads_close(grads, ref_grads, TOL[torch.float64], FLOOR[torch.float64])
    zero_grads(model)


def test_block_recompute_equals_the_hf_reference(gen):
    """Calls whose decoder blocks are recomputed in the backward (a small memory budget, 16
    layers): the routing is recomputed identically."""
    from treerl.engine.memory import MemoryModel

    model = tiny_model("qwen3_moe", randomise=7, vocab_size=VOCAB, num_hidden_layers=16, **MOE)
    ref = hf_reference(model)
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen)
    _, ref_grads, ref_lps, _ = reference_step(ref, seqs, loss)
    m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
    budget = int(m.fixed + 6 * m.per_token + 36 * m.per_pair) + 1  # calls over 6 tokens recompute their blocks
    engine = TreeEngine(model, "auto", memory_budget=budget, chunk_tokens=4)
    zero_grads(model)
    engine.forward_backward(seqs, loss)
    assert engine.stats.recomputed_calls >= 1, engine.stats
    assert_grads_close(grads_of(model), ref_grads, TOL[torch.float64], FLOOR[torch.float64])
    assert_seq_close(engine.logprobs(seqs), ref_lps, TOL[torch.float64])
    zero_grads(model)


def test_float32_grouped_kernel_equals_the_reference(gen):
    """float32: the experts through PyTorch's grouped GEMM (not the fallback), to 1e-5."""
    model = tiny_model("qwen3_moe", torch.float32, randomise=5, vocab_size=VOCAB, **MOE)
    experts = model.model.layers[0].mlp.experts
    assert moe._grouped_kernel_takes(torch.zeros(1, 64), experts.gate_up_proj.transpose(-2, -1))
    ref = hf_reference(model)
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen, one_sign=True)
    _, ref_grads, ref_lps, _ = reference_step(ref, seqs, loss)
    engine = TreeEngine(model, "packed", max_tokens=48)
    assert_seq_close(engine.logprobs(seqs), ref_lps, TOL[torch.float32])
    zero_grads(model)
    engine.forward_backward(seqs, loss)
    assert_grads_close(grads_of(model), ref_grads, TOL[torch.float32], FLOOR[torch.float32])
    zero_grads(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_linear_equals_per_expert_products(dtype, gen):
    """Both routes of :func:`treerl.moe.grouped_linear` (grouped kernel, padded batched
    matmul) against one product per expert, including experts with no rows; gradients too."""
    E, S, d_in, d_out = 5, 23, 16, 8
    experts = torch.sort(torch.randint(0, E, (S,), generator=gen).masked_fill(torch.arange(S) % 7 == 0, 3))[0]
    experts[experts == 1] = 2  # expert 1 gets no row
    counts = torch.bincount(experts, minlength=E)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(S, d_in, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(E, d_out, d_in, generator=gen, dtype=dtype, requires_grad=True)
    got = moe.grouped_linear(x, w, ends, experts)
    want = torch.cat([x[experts == e] @ w[e].T for e in range(E)])
    assert (dtype == torch.float32) == moe._grouped_kernel_takes(x, w.transpose(-2, -1))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    g = torch.randn(got.shape, generator=gen, dtype=dtype)
    gx, gw = torch.autograd.grad(got, (x, w), g)
    wx, ww = torch.autograd.grad(want, (x, w), g)
    assert torch.allclose(gx, wx, rtol=tol, atol=tol) and torch.allclose(gw, ww, rtol=tol, atol=tol)
    assert gw[1].abs().max() == 0


def test_rollout_greedy_equals_full_forwards(gen):
    """The own decode blocks with sparse MoE layers (routing per row, grouped experts) and
    the HF prefill: greedy output equals a per-prompt full forward of the same model."""
    model = tiny_model("qwen3_moe", randomise=11, vocab_size=512, **MOE)
    engine = RolloutEngine(model, max_batch_tokens=4096)
    assert engine.decode_blocks is not None
    assert all(w is None for w in engine.decode_blocks.fused.gate_up_w)  # every MLP is sparse
    prompts = random_prompts([5, 9, 3, 12], seed=2)
    groups = engine.generate(prompts, sampling(16, n=2))
    for prompt, group in zip(prompts, groups):
        want = greedy_reference(model, prompt, 16)
        for c in group.completions:
            assert c.completion_ids.tolist() == want


def test_memory_model_counts_routed_activations_and_expert_weights():
    from treerl.engine.memory import MemoryModel, expert_weight_bytes, mlp_activation_bytes
    from treerl.models import make_config

    cfg = make_config("qwen3_moe", "qwen3-30b-a3b", num_hidden_layers=4)
    k, mi, h, E = 8, 768, 2048, 128
    assert mlp_activation_bytes(cfg, 2) == 2 * (k * (4 * mi + 3 * h) + E) + 4 * E  # + float32 router probabilities
    dense = make_config("qwen3", "qwen3-1.7b")
    assert mlp_activation_bytes(dense, 2) == 2 * 4 * dense.intermediate_size
    half = make_config("qwen3_moe", "qwen3-30b-a3b", num_hidden_layers=4, mlp_only_layers=[0, 2])
    assert mlp_activation_bytes(half, 2) == (mlp_activation_bytes(cfg, 2) + 2 * 4 * half.intermediate_size) / 2
    total, active = expert_weight_bytes(cfg, torch.bfloat16)
    assert total == 4 * E * 3 * h * mi * 2 and active == 4 * k * 3 * h * mi * 2
    assert expert_weight_bytes(dense, torch.bfloat16) == (0, 0)
    est = MemoryModel.estimate(cfg, torch.bfloat16)
    as_dense = MemoryModel.estimate(make_config("qwen3", None, **{name: getattr(cfg, name) for name in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size")}), torch.bfloat16)
    routed, mlp = mlp_activation_bytes(cfg, 2), mlp_activation_bytes(dense, 2) * 6144 / dense.intermediate_size
    assert est.per_token - as_dense.per_token == pytest.approx((routed - mlp) * 4 * 1.25)


def test_a_saved_moe_directory_loads_with_treerl_blocks(tmp_path):
    model = tiny_model("qwen3_moe", torch.float32, randomise=3, vocab_size=VOCAB, **MOE)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert all(m.forward.__func__ is moe.moe_forward for m in loaded.modules() if moe.is_moe_block(m))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


# ------------------------------------------------------------- the router's auxiliary loss
def reference_aux(ref, seqs, coef):
    """The load-balancing loss of the flat batch from per-sequence HF forwards: every layer's
    router logits (HF's output_router_logits) of positions 0..L-2, pooled."""
    probs, top = [], []
    for s in seqs:
        out = ref(input_ids=torch.as_tensor(s)[None], output_router_logits=True)
        for logits in out.router_logits:
            p = torch.softmax(logits[: len(s) - 1].double(), -1)
            probs.append(p)
            top.append(torch.topk(p, ref.config.num_experts_per_tok, -1).indices)
    probs, top = torch.cat(probs), torch.cat(top)
    E = ref.config.num_experts
    f = torch.zeros(E, dtype=torch.float64).index_add_(0, top.reshape(-1), torch.ones(top.numel(), dtype=torch.float64))
    f = f / len(probs)
    return coef * E * (f * probs.mean(0)).sum()


@pytest.mark.parametrize("mode", ["flat", "packed", "dfs", "auto"])
def test_router_aux_loss_is_exact(mode, gen):
    from treerl.moe_aux import forward_backward_with_router_aux

    model = tiny_model("qwen3_moe", randomise=int(torch.randint(0, 1000, (1,), generator=gen)), vocab_size=VOCAB, **MOE)
    ref = hf_reference(model)
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen)
    coef = 0.37
    zero_grads(ref)
    lps, _ = reference_logprobs(ref, seqs)
    want_aux = reference_aux(ref, seqs, coef)
    (loss(lps) + want_aux).backward()
    ref_grads = grads_of(ref)
    engine = TreeEngine(model, mode, **MODE_KW[mode])
    zero_grads(model)
    total, aux = forward_backward_with_router_aux(engine, seqs, loss, coef, separable=mode == "flat")
    assert coef * aux == pytest.approx(float(want_aux), rel=1e-9)
    assert total == pytest.approx(float(loss(lps) + want_aux), rel=1e-9)
    assert_grads_close(grads_of(model), ref_grads, TOL[torch.float64], FLOOR[torch.float64])
    # the aux term changes the router's gradient (else this proves nothing)
    zero_grads(model)
    engine.forward_backward(seqs, loss)
    plain = grads_of(model)["model.layers.0.mlp.gate.weight"]
    assert (plain - ref_grads["model.layers.0.mlp.gate.weight"]).norm() > 1e-6 * plain.norm()
    zero_grads(model)


def test_a_trainer_step_with_the_router_aux_loss(tmp_path):
    from treerl.config import ConfigError
    from treerl.trainer import Trainer

    base = ("rollout.prompts_per_step=2", "rollout.group_size=3")  # run_config(tmp_path, *base, ..., layers=None)
    cfg = run_config(tmp_path, *base, "model.family=qwen3_moe", "model.shape=tiny-moe", "algorithm.router_aux_coef=0.01",
                     layers=None)
    trainer = Trainer(cfg)
    gate = trainer.model.model.layers[0].mlp.gate.weight
    before = gate.detach().clone()
    metrics = trainer.step()
    assert metrics["loss/router_aux"] > 0 and not torch.equal(gate, before)
    with pytest.raises(ConfigError, match="router_aux_coef > 0 needs a mixture-of-experts model"):
        Trainer(run_config(tmp_path, *base, "algorithm.router_aux_coef=0.01", layers=None))
    with pytest.raises(ConfigError, match="algorithm.router_aux_coef: -1.0 is not allowed; allowed: >= 0"):
        Trainer(run_config(tmp_path, *base, "model.family=qwen3_moe", "model.shape=tiny-moe", "algorithm.router_aux_coef=-1",
                           layers=None))
