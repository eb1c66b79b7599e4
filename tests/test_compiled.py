"""treerl.compiled: the one compile helper. Compiled at the first call, never before; a
compiler failure is one CompileError line naming what failed and the switch that turns it
off (no eager fallback); an error of the function's own passes through unchanged. (That a
compiled function computes what the eager one does is checked where it is used: the
compiled decode blocks, tests/rollout/test_rollout_stream.py; the compiled training
blocks, tests/test_lora.py.)"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import TorchRuntimeError

import treerl.compiled as compiled
from treerl.compiled import CompileError, LazyCompiled


def test_compiles_at_the_first_call_and_names_the_switch_on_failure(monkeypatch):
    calls = []

    def fake_compile(fn, dynamic):
        calls.append(dynamic)

        def run(*args, **kwargs):
            raise TorchRuntimeError("no C compiler found")
        return run

    monkeypatch.setattr(compiled.torch, "compile", fake_compile)
    f = LazyCompiled(torch.add, "test part", "turn it off with test_off=True")
    assert not f.compiled and calls == []  # declaring one compiles nothing
    with pytest.raises(CompileError) as err:
        f(torch.ones(2), torch.ones(2))
    assert calls == [True] and f.compiled
    message = str(err.value)
    assert "\n" not in message and "test part" in message and "no C compiler found" in message
    assert message.endswith("turn it off with test_off=True")
    with pytest.raises(CompileError):  # again: the same error, no eager fallback
        f(torch.ones(2), torch.ones(2))
    assert calls == [True]  # compiled once


def test_the_function_own_errors_pass_through(monkeypatch):
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, dynamic: fn)  # "compiled" = eager
    f = LazyCompiled(lambda x, *, scale: x * scale, "test part", "off")
    assert torch.equal(f(torch.ones(2), scale=3.0), torch.full((2,), 3.0))  # keyword arguments reach it

    def bad(x):
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        LazyCompiled(bad, "test part", "off")(torch.ones(1))


def test_dynamo_caches_dropped_when_a_model_of_another_configuration_is_compiled(monkeypatch):
    """Compiled code claimed for a model of another configuration drops dynamo's caches
    (the H100's wrong gradients after other models filled them: treerl.compiled); copies of
    one configuration keep sharing them (no reset)."""
    import copy

    import treerl.compiled as compiled
    from helpers.models import tiny_model

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(compiled, "_CONFIG_COMPILED", None)
    a = tiny_model(seed=0)
    compiled.claim_compiled_code(a)
    compiled.claim_compiled_code(copy.deepcopy(a))  # a reference copy: same configuration
    compiled.claim_compiled_code(tiny_model(seed=1))  # other weights, same configuration
    assert resets == []
    compiled.claim_compiled_code(tiny_model(seed=0, num_hidden_layers=3))
    assert resets == [1]
    compiled.claim_compiled_code(tiny_model(dtype=torch.float32))
    assert resets == [1, 1]


def test_compiling_raises_dynamos_recompile_limit():
    """Past dynamo's per-function limit a compiled function runs eagerly without a word: the
    first compile raises the limit to treerl's (never lowers a higher one). (dynamo's config
    is patched through its own context manager: monkeypatch would delete the entry on undo.)"""
    import treerl.compiled as compiled

    with torch._dynamo.config.patch(recompile_limit=8):
        LazyCompiled(lambda x: x + 1, "a test function", "off")(torch.ones(2))
        assert torch._dynamo.config.recompile_limit == compiled.RECOMPILE_LIMIT
    with torch._dynamo.config.patch(recompile_limit=1000):
        compiled.raise_recompile_limit()
        assert torch._dynamo.config.recompile_limit == 1000
