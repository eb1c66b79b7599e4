"""The prefill forward's warm-up (:meth:`treerl.rollout.prefill_blocks.PrefillForward.warm`): after it, a
prefill of any rows and queries compiles nothing more (CPU, dynamo through its aot_eager backend: the same
guards and graphs as on a GPU, no code generation), and without it a new class of shapes met mid-run does
(session 38: 14 rows of one new token each stalled a served batch 4.9-8.8 s on an H200)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._dynamo.utils import counters

from helpers.dynamo import aot_eager, fresh
from helpers.models import tiny_model
from treerl.rollout import RolloutEngine, prefill_blocks
from treerl.rollout.kv import rollout_attention_enabled
from treerl.serve import EngineLoop


@pytest.fixture(scope="module")
def model():
    return tiny_model(dtype=torch.float32)


@pytest.fixture
def compiled_prefill(monkeypatch, model):
    """An engine whose prefill forward runs ``pre`` and the block's rest through fresh ``torch.compile``
    wrappers (aot_eager backend), dynamo's caches reset around the test."""
    aot_eager(monkeypatch)
    engine = RolloutEngine(model, compile_decode=False)
    forward = engine.prefiller.forward
    assert forward is not None and not forward.compiled
    forward.pre, forward.tail = fresh(prefill_blocks._PRE), fresh(prefill_blocks._TAIL)
    assert forward.compiled
    torch._dynamo.reset()
    yield engine
    torch._dynamo.reset()


# rows x new tokens of the prefills a server meets, in an order that brings each class late: one row of many
# tokens, many rows of one token (every turn's prompt from the prefix cache but its last token), a row of one
# token, rows of a few tokens each
PREFILLS = ([37], [2] * 6, [1] * 14, [1], [9, 16, 5], [3, 3])


def _prefill(engine: RolloutEngine, lengths: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad(), rollout_attention_enabled(engine.model):
        return engine.prefiller(seqs)[2]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_after_the_warm_up_no_prefill_compiles(compiled_prefill):
    engine = compiled_prefill
    before = _graphs()
    assert engine.warm_prefill() == len(prefill_blocks.WARM_SHAPES)
    warmed = _graphs()
    assert warmed > before
    for lengths in PREFILLS:
        _prefill(engine, lengths)
        assert _graphs() == warmed, f"a prefill of {len(lengths)} rows x {max(lengths)} tokens compiled"


def test_without_it_a_new_class_compiles_mid_run(compiled_prefill):
    """The control: the same prefills without the warm-up compile as each class first comes."""
    engine = compiled_prefill
    _prefill(engine, PREFILLS[0])
    first = _graphs()
    for lengths in PREFILLS[1:]:
        _prefill(engine, lengths)
    assert _graphs() > first


def test_the_warm_up_leaves_the_prefills_results_as_they_were(model):
    """Eager (the CPU default): nothing to compile, and a prefill after a warm-up call returns the same logits."""
    engine = RolloutEngine(model)
    ref = _prefill(engine, [9, 16, 5])
    assert engine.warm_prefill() == 0
    assert torch.equal(_prefill(engine, [9, 16, 5]), ref)


def test_the_serving_loop_warms_before_its_first_stream(model, monkeypatch):
    engine = RolloutEngine(model)
    warmed = threading.Event()
    monkeypatch.setattr(engine, "warm_prefill", lambda: warmed.set() or 0)
    loop = EngineLoop(engine)
    try:
        assert warmed.wait(30)
    finally:
        loop.stop()


def test_a_failed_warm_up_leaves_the_loop_serving(model, monkeypatch, caplog):
    """The error is logged; requests still run (the first prefill would raise it again if it were real)."""
    from treerl.rollout import SamplingParams

    engine = RolloutEngine(model)

    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(engine, "warm_prefill", broken)
    with caplog.at_level("WARNING", logger="treerl.serve.loop"):
        loop = EngineLoop(engine)
        try:
            out = loop.submit([1, 2, 3], SamplingParams(n=1, max_new_tokens=2, temperature=0.0)).result(60)
        finally:
            loop.stop()
    assert len(out) == 1 and len(out[0].completion_ids) == 2
    assert "no compiler here" in caplog.text
