"""Triton kernels compiled for Hopper (sm_90) on any machine, as their launchers call them: a recorder stands in for
a ``@triton.jit`` kernel, then each recorded launch compiles ahead of time (``triton.compile`` with a ``GPUTarget``:
front end, LLVM and ``ptxas``, no GPU needed). The launch's signature, its arguments specialised to constants
(integers equal to 1) and its divisibility hints come from Triton's own binder, as the runtime builds them (private
API of the pinned Triton 3.6.0), so the compiled variant is the one the GPU compiles. Used by
``tests/rollout/test_triton_compile.py`` and ``bench/kernel_sass.py``."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY = 232_448  # bytes of shared memory one program may take on sm_90 (227 KB)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def compile_launches(recorder: Recorder) -> list:
    """Compiles each recorded launch for sm_90 as the runtime would (each must fit an SM's shared memory); returns
    the compiled kernels (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``) and clears the record."""
    kernel, backend = recorder.kernel, make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    compiled = []
    for args, kwargs in recorder.calls:
        bound, specialization, options = binder(*args, **dict(kwargs))
        options, signature, constexprs, attrs = kernel._pack_args(backend, dict(kwargs), bound, specialization,
                                                                  options)
        c = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                           target=HOPPER, options=options.__dict__)
        assert c.asm["cubin"] and c.metadata.shared <= SHARED_MEMORY, (kernel.__name__, c.metadata.shared)
        compiled.append(c)
    recorder.calls.clear()
    return compiled
