"""The one way treerl compiles a function: :class:`LazyCompiled`.

``torch.compile`` with dynamic shapes, at the function's first call (declaring one at
import costs nothing, and a run that never calls it never compiles). A compiler failure
is a :class:`CompileError` naming what failed and how to run without compiling; nothing
falls back to eager silently or with a warning: an eager decoder block, decode step or
flex attention is several times slower (eager flex also holds the whole score matrix),
and a run that quietly lost its speed is harder to diagnose than one that stops.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch._dynamo.exc import TorchDynamoException


# How to run without each compiled part (the ``off`` of :class:`LazyCompiled`).
ENGINE_OFF = "turn compilation off with TreeEngine(compile=False) (engine.compile=false in a run's config)"
FLEX_OFF = "use the SDPA backend instead: TreeEngine(attention='sdpa') (engine.attention=sdpa; slower on CUDA)"
DECODE_OFF = "turn compilation off with RolloutEngine(compile_decode=False)"


# dynamo's per-function limit of compiled variants, raised from its default (8): treerl's compiled
# functions take a variant per grad mode, per whether the loss head's input needs grad, per model
# configuration (tests, benchmarks), and past the limit dynamo runs the function eagerly, silently:
# slower, and on the H100 the state in which compiled + recomputed blocks gave wrong gradients
# (bench/gradbug_probe.py, 2026-11-24; see claim_compiled_code).
RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Raise ``torch._dynamo.config.recompile_limit`` to :data:`RECOMPILE_LIMIT` (never lower it)."""
    config = torch._dynamo.config
    if getattr(config, "recompile_limit", RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
        config.recompile_limit = RECOMPILE_LIMIT


_DYNAMO_CONFIG_LOCK = threading.RLock()  # held by a LazyCompiled call that sets dynamo options around itself


class CompileError(RuntimeError):
    """``torch.compile`` of one of treerl's functions failed, explained in one line."""


class LazyCompiled:
    """``fn`` through ``torch.compile(dynamic=True)``, compiled at the first call.

    ``what``: what ``fn`` is, for the error; ``off``: how to run without compiling it (the
    switch that turns it off), for the error too. ``dynamo``: dynamo config values set
    around every call (where this torch has them; compilation happens inside a call).
    """

    def __init__(self, fn: Callable, what: str, off: str, dynamo: dict | None = None):
        self.eager, self.what, self.off = fn, what, off
        self._fn: Callable | None = None
        config = torch._dynamo.config
        self._dynamo = {k: v for k, v in (dynamo or {}).items() if hasattr(config, k)}

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            raise_recompile_limit()
            self._fn = torch.compile(self.eager, dynamic=True)
        try:
            if self._dynamo:  # set and restored directly: ~4x cheaper than config.patch, every call
                with _DYNAMO_CONFIG_LOCK:  # the config is the process's: one call at a time sets it
                    config = torch._dynamo.config
                    before = {k: getattr(config, k) for k in self._dynamo}
                    for k, v in self._dynamo.items():
                        setattr(config, k, v)
                    try:
                        return self._fn(*args, **kwargs)
                    finally:
                        for k, v in before.items():
                            setattr(config, k, v)
            return self._fn(*args, **kwargs)
        except TorchDynamoException as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise CompileError(f"torch.compile of the {self.what} failed ({type(err).__name__}: {detail}); "
                               f"{self.off}") from err

    @property
    def compiled(self) -> bool:
        """Whether it has run compiled (it has been called)."""
        return self._fn is not None


_CONFIG_COMPILED: str | None = None  # the configuration of the last model compiled code was claimed for


def claim_compiled_code(model: torch.nn.Module) -> None:
    """Call before compiled code of treerl's runs for ``model``: when the last model it was
    claimed for had another configuration (architecture, sizes, dtype), dynamo's caches are
    dropped (``torch._dynamo.reset()``); models of one configuration (a policy, its
    reference and critic copies, the rollout's) keep sharing them.

    Why: treerl's compiled functions (decoder blocks, flex attention, loss head, decode
    blocks) are module-level, so dynamo keeps one cache per function for every model of a
    process. On an H100 (``bench/gradbug_probe.py``, 2026-11-24), after engines of other
    configurations had filled those caches to dynamo's recompile limit, a new model's
    compiled and recomputed decoder blocks gave parameter gradients off by 50-90%; with the
    caches dropped first (or the blocks eager) they were exact. The cause inside dynamo is
    not established; dropping the caches when the configuration changes is the mitigation."""
    global _CONFIG_COMPILED
    config = getattr(model, "config", None)
    dtype = next((p.dtype for p in model.parameters()), None)
    key = f"{type(model).__name__}|{dtype}|{config.to_json_string(use_diff=False) if config is not None else ''}"
    if _CONFIG_COMPILED is not None and key != _CONFIG_COMPILED:
        torch._dynamo.reset()
    _CONFIG_COMPILED = key
