"""Compiled functions under test on the CPU: dynamo through its aot_eager backend (the same guards and
graphs as inductor's, no code generation), and fresh copies of treerl's lazily compiled functions."""

from __future__ import annotations

import copy

import torch

import treerl.compiled as compiled


def fresh(fn: compiled.LazyCompiled) -> compiled.LazyCompiled:
    """A copy of ``fn`` that compiles again at its first call (through whatever ``torch.compile`` is then)."""
    out = copy.copy(fn)
    out._fn = None
    return out


def aot_eager(monkeypatch) -> None:
    """:class:`~treerl.compiled.LazyCompiled` compiles through dynamo's aot_eager backend for the test."""
    real = torch.compile
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, dynamic: real(fn, dynamic=dynamic, backend="aot_eager"))
