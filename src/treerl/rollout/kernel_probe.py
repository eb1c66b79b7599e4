"""The one way a decode kernel is admitted: run once against its reference on the device
(outside any capture); on disagreement or an error, warn with the reason and take the
slower path, so a fallback never passes unnoticed (a benchmark would otherwise time the
fallback under the kernel's name)."""

from __future__ import annotations

import warnings
from typing import Callable


def kernel_agrees(check: Callable[[], bool], *, what: str, reference: str, where: str, fallback: str) -> bool:
    """``check()``: whether the kernel ran and matched ``reference``. False, with a warning
    naming ``what`` failed or disagreed, ``where`` and the ``fallback`` taken, when it did
    not (or raised)."""
    try:
        if check():
            return True
        why = f"disagreed with {reference}"
    except Exception as err:  # noqa: BLE001 - any failure: the fallback
        why = f"failed ({type(err).__name__}: {err})"
    warnings.warn(f"{what} {why} on {where}; {fallback}")
    return False
