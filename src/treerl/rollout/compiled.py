"""A function compiled at its first call, eager if compilation fails."""

from __future__ import annotations

import warnings
from typing import Callable

import torch


class LazyCompiled:
    """``fn`` through ``torch.compile`` (dynamic shapes), compiled at the first call; if that
    fails, a warning and ``fn`` eagerly from then on."""

    def __init__(self, fn: Callable, what: str):
        self.eager, self.what, self.fn, self.tried = fn, what, None, False

    def __call__(self, *args):
        if self.tried:
            return self.fn(*args)
        self.tried = True
        try:
            self.fn = torch.compile(self.eager, dynamic=True)
            return self.fn(*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: eager
            warnings.warn(f"torch.compile of the {self.what} failed ({type(err).__name__}: {err}); running eagerly")
            self.fn = self.eager
            return self.fn(*args)

    @property
    def compiled(self) -> bool:
        return self.fn is not self.eager
