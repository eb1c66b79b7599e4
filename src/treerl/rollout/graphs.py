"""CUDA-graph capture of one decode step, shared by the wave and the streaming decoders."""

from __future__ import annotations

import warnings

import torch


def capture_decode_step(engine, forward) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
    """Capture ``forward`` (a decode step with static inputs) as a CUDA graph: one eager
    warm-up run on a side stream (it writes the step's K/V, which replays rewrite
    identically), then the capture. Returns (graph, its output tensor), or (None, the
    eager output) when the model cannot be captured (then the engine stops using graphs).

    Holds ``engine.device_lock``: device work of another thread during a capture
    (a weight receiver's copy or NCCL broadcast) would invalidate it."""
    with engine.device_lock:
        dev = engine.device
        stream, current = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            forward()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = forward()
        except RuntimeError as err:  # a model that cannot be captured: run its steps eagerly
            warnings.warn(f"CUDA graph capture failed ({err}); decoding without CUDA graphs")
            engine.cuda_graphs = False
            return None, forward()
        return graph, out
