"""Compiled decoder blocks (CPU, ``torch.compile``): how many graphs the first step compiles
(issue 24 item 4: each costs ~1.1-1.5 s of dynamo tracing on an H100 even with every kernel
cached), and that they compute what the eager blocks do, in float64, with and without grad and
block recompute."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.dynamo import aot_eager, fresh
from helpers.forests import SMALL_SPEC, RandomLoss, shaped_forest
from helpers.models import get_model
from helpers.reference import FLOOR, assert_grads_close, assert_seq_close, grads_of, reference_step, zero_grads
from treerl import TreeEngine
from treerl.engine import decoder, loss_head
from treerl.engine.attention import TreeAttention, tree_attention_enabled
from treerl.engine.memory import MemoryModel

SPEC = SMALL_SPEC


@pytest.fixture
def eager_backend(monkeypatch):
    """Fresh compiled blocks and loss head through dynamo's aot_eager backend (the same graphs, no
    code generation)."""
    aot_eager(monkeypatch)
    monkeypatch.setattr(decoder, "_BLOCK", fresh(decoder._BLOCK))
    monkeypatch.setattr(loss_head, "_COMPILED", tuple(fresh(f) for f in loss_head._COMPILED))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "nested_graph_breaks"),
                    reason="this torch has no nested_graph_breaks (torch 2.11: the graph break still bubbles up)")
def test_a_block_is_two_graphs_whatever_its_position_ids_are_a_view_of(gen, eager_backend):
    """The tree attention's graph break resumes inside the block (nested graph breaks): one graph
    before it, one after, over two frames; not a graph per transformers frame (the checkpointing
    __call__, deprecate_kwarg's wrapper, the layer's and the attention's forward and their
    resumes). The memory probe's position ids and a call's (views of bases of other lengths)
    share them."""
    model = get_model("qwen3")
    engine = TreeEngine(model, "packed", max_tokens=64, compile=True)
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    base = engine.runner.stack.base
    for n in (11, 17):  # as the CUDA memory probe: its own arange, grad, no backward
        index = torch.arange(n)
        ctx = TreeAttention("sdpa", index, index, torch.full((n,), n))
        with torch.enable_grad(), tree_attention_enabled(base, ctx):
            engine.runner.stack(torch.randint(0, 50, (1, n), generator=gen), index[None])
    seqs = shaped_forest(gen, SPEC)
    engine.forward_backward(seqs, RandomLoss.make(seqs, gen))
    block_frames = counters["frames"]["total"] - frames
    block_graphs = counters["stats"]["unique_graphs"] - graphs
    # + the loss head's chunk forward and gradient
    assert (block_frames, block_graphs) == (4, 4), (block_frames, block_graphs)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_compiled_blocks_equal_the_reference_float64(gen, recompute):
    """inductor's float64 blocks against the per-sequence reference: the gradient step (with
    block recompute or without) and a no-grad forward (another grad mode of the same graphs)."""
    model = get_model("qwen3")
    seqs = shaped_forest(gen, SPEC)
    loss = RandomLoss.make(seqs, gen)
    _, ref_grads, ref_lps, _ = reference_step(model, seqs, loss)
    if recompute:  # as tests/test_lora.py: calls over 6 tokens recompute their blocks
        m = MemoryModel.estimate(model.config, torch.float64, dense_mask=True)
        budget = int(m.fixed + 6 * m.per_token + 36 * m.per_pair) + 1
        engine = TreeEngine(model, "auto", memory_budget=budget, chunk_tokens=4, compile=True)
    else:
        engine = TreeEngine(model, "packed", max_tokens=64, compile=True)
    assert engine.runner.stack.compile
    zero_grads(model)
    engine.forward_backward(seqs, loss)
    if recompute:
        assert engine.stats.recomputed_calls >= 1, engine.stats
    # inductor's fused float64 kernels round differently (as tests/test_lora.py: 1e-8)
    assert_grads_close(grads_of(model), ref_grads, 1e-8, FLOOR[torch.float64])
    assert_seq_close(engine.logprobs(seqs), ref_lps, 1e-8)
    zero_grads(model)
