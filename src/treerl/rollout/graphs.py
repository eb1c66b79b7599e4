"""Capturing a forward with static inputs as a CUDA graph: the running batch's decode steps
(:class:`~treerl.rollout.step.DecodeStep`) and the small prefills
(:class:`~treerl.rollout.prefill_graphs.PrefillGraphs`), each captured at its first use."""

from __future__ import annotations

import warnings

import torch

from ..compiled import CompileError


def capture_graph(engine, forward, owner, what: str, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
    """Capture ``forward`` (a forward with static inputs) as a CUDA graph: ``warmups`` eager
    runs on a side stream (they write what a replay rewrites identically), then the capture
    (tried twice). Returns (graph, its output tensor; filled by a replay, not by the
    capture), or (None, the eager output) when the model cannot be captured, with a
    warning naming ``what`` (the caller stops using graphs for it).

    ``owner`` (an object that lives as long as the graphs) holds the memory pool shared by
    its graphs (``owner.graph_pool``). Holds ``engine.device_lock``: device work of another thread during a capture
    (a weight receiver's copy or NCCL broadcast) would invalidate it."""
    with engine.device_lock:
        dev = engine.device
        if getattr(owner, "graph_pool", None) is None:
            owner.graph_pool = torch.cuda.graph_pool_handle()
        for attempt in range(2):
            # warm-up (the decode steps': twice, as a compiled part may compile again at its
            # second call: a guard that its first call specialised); compiling inside a
            # capture breaks the capture, and the second attempt warms up again
            stream, current = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(warmups):
                    forward()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # one memory pool for all the graphs of ``owner``: they replay one at a time and
                # each keeps its output tensor alive, so their temporaries may share memory. Not
                # the engine's: once every graph of a pool is freed the pool goes, and capturing
                # into its handle again fails an allocator assert (seen in the trainer, whose
                # streams keep no buffers)
                with torch.cuda.graph(graph, pool=owner.graph_pool):
                    out = forward()
                return graph, out
            except CompileError:
                raise  # not a capture problem: never hidden behind the eager fallback
            except RuntimeError as err:
                error = err
        warnings.warn(f"CUDA graph capture of the {what} failed twice ({error}); running it without CUDA graphs")
        return None, forward()
