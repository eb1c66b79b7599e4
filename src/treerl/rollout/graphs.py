"""One decode step with static inputs, run eagerly or as a CUDA graph captured at its
first use (the running batch's :class:`~treerl.rollout.step.DecodeStep`)."""

from __future__ import annotations

import warnings

import torch

from ..compiled import CompileError


def capture_decode_step(engine, forward, owner) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
    """Capture ``forward`` (a decode step with static inputs) as a CUDA graph: eager warm-up
    runs on a side stream (they write the step's K/V, which replays rewrite identically),
    then the capture (tried twice). Returns (graph, its output tensor), or (None, the
    eager output) when the model cannot be captured (then the engine stops using graphs).

    ``owner`` (an object that lives as long as the graphs) holds the memory pool shared by
    its graphs (``owner.graph_pool``). Holds ``engine.device_lock``: device work of another thread during a capture
    (a weight receiver's copy or NCCL broadcast) would invalidate it."""
    with engine.device_lock:
        dev = engine.device
        if getattr(owner, "graph_pool", None) is None:
            owner.graph_pool = torch.cuda.graph_pool_handle()
        for attempt in range(2):
            # warm-up, twice: a compiled part may compile again at its second call (a guard that
            # its first call specialised), and compiling inside a capture breaks the capture
            stream, current = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                forward()
                forward()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # one memory pool for all the decode graphs of ``owner`` (a running batch): they
                # replay one at a time and each keeps its output tensor alive, so their
                # temporaries may share memory. Not the engine's: once every graph of a pool is
                # freed the pool goes, and capturing into its handle again fails an allocator
                # assert (seen in the trainer, whose streams keep no buffers)
                with torch.cuda.graph(graph, pool=owner.graph_pool):
                    out = forward()
                return graph, out
            except CompileError:
                raise  # not a capture problem: never hidden behind the eager fallback
            except RuntimeError as err:
                error = err
        # a model that cannot be captured: run its steps eagerly
        warnings.warn(f"CUDA graph capture failed twice ({error}); decoding without CUDA graphs")
        engine.cuda_graphs = False
        return None, forward()
