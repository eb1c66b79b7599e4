"""The one way treerl compiles a function: :class:`LazyCompiled`.

``torch.compile`` with dynamic shapes, at the function's first call (declaring one at
import costs nothing, and a run that never calls it never compiles). A compiler failure
is a :class:`CompileError` naming what failed and how to run without compiling; nothing
falls back to eager silently or with a warning: an eager decoder block, decode step or
flex attention is several times slower (eager flex also holds the whole score matrix),
and a run that quietly lost its speed is harder to diagnose than one that stops.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._dynamo.exc import TorchDynamoException


# How to run without each compiled part (the ``off`` of :class:`LazyCompiled`).
ENGINE_OFF = "turn compilation off with TreeEngine(compile=False) (engine.compile=false in a run's config)"
FLEX_OFF = "use the SDPA backend instead: TreeEngine(attention='sdpa') (engine.attention=sdpa; slower on CUDA)"
DECODE_OFF = "turn compilation off with RolloutEngine(compile_decode=False)"
SAMPLING_OFF = "CUDA sampling without truncation needs a working torch.compile (Triton) on this machine"


class CompileError(RuntimeError):
    """``torch.compile`` of one of treerl's functions failed, explained in one line."""


class LazyCompiled:
    """``fn`` through ``torch.compile(dynamic=True)``, compiled at the first call.

    ``what``: what ``fn`` is, for the error; ``off``: how to run without compiling it (the
    switch that turns it off), for the error too.
    """

    def __init__(self, fn: Callable, what: str, off: str):
        self.eager, self.what, self.off = fn, what, off
        self._fn: Callable | None = None

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            self._fn = torch.compile(self.eager, dynamic=True)
        try:
            return self._fn(*args, **kwargs)
        except TorchDynamoException as err:
            detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise CompileError(f"torch.compile of the {self.what} failed ({type(err).__name__}: {detail}); "
                               f"{self.off}") from err

    @property
    def compiled(self) -> bool:
        """Whether it has run compiled (it has been called)."""
        return self._fn is not None
