"""Graph capture and replay on neuron, mirroring ``torch.cuda``'s ``CUDAGraph`` / ``graph``.

``NeuronGraph`` is ``torch.accelerator.Graph`` on this device (``csrc/backend/graph.cpp``): a
capture records the kernels neuron queues on the capturing stream (in-place and ``out=`` ops,
elementwise ops over same-shaped operands, foreach lists, small copies and fills) without
running them; ``replay()`` enqueues them again over the same memory. An op whose kernel runs
synchronously on neuron (matmuls, reductions, ...) or a host wait inside the capture raises and
fails it. See docs/architecture.md, *Graphs*.
"""

from __future__ import annotations

import gc
from typing import Optional

import torch

from .. import _C

__all__ = ["NeuronGraph", "graph", "is_current_stream_capturing"]


class NeuronGraph(torch.accelerator.Graph):
    """``torch.cuda.CUDAGraph`` for neuron (``torch.accelerator.Graph`` itself)."""


def is_current_stream_capturing() -> bool:
    """Whether a graph capture is open (``torch.cuda.is_current_stream_capturing``; neuron
    captures one stream at a time)."""
    return bool(_C._engine_capturing())


class graph:
    """Context manager capturing the work of its body into ``neuron_graph``, as
    ``torch.cuda.graph``: it synchronizes, collects garbage, then captures on ``stream`` (a side
    stream by default, shared by every ``graph`` context, as CUDA's)."""

    default_capture_stream: Optional[torch.Stream] = None

    def __init__(self, neuron_graph: NeuronGraph, pool: Optional[tuple] = None,
                 stream: Optional[torch.Stream] = None, capture_error_mode: str = "global") -> None:
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = torch.neuron.Stream()
            stream = graph.default_capture_stream
        self.neuron_graph = neuron_graph
        self.pool = pool
        self.capture_stream = stream
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        torch.neuron.synchronize()
        gc.collect()
        self._stream_ctx = torch.neuron.stream(self.capture_stream)
        self._stream_ctx.__enter__()
        try:
            if self.pool is not None:
                self.neuron_graph.graph_pool = self.pool  # (refused unless empty: no shared pools)
            self.neuron_graph.capture_begin()
        except BaseException:
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            self.neuron_graph.capture_end()
        finally:
            self._stream_ctx.__exit__(*exc)
