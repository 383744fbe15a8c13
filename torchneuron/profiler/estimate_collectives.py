"""Alpha-beta estimate of a collective over the platform's links.

A collective of ``B`` bytes over ``n`` ranks runs as a ring (the usual schedule on NeuronLink
rings and tori):

* all-reduce: ``2(n-1)/n * B / bw + 2(n-1) * alpha``
* all-gather, reduce-scatter, all-to-all: ``(n-1)/n * B_total / bw + (n-1) * alpha``
* broadcast, reduce (pipelined ring): ``B / bw + (n-1) * alpha``
* send / recv: ``B / bw + alpha``; barrier: ``2(n-1) * alpha``

``alpha`` is one DMA transfer's fixed cost (``Platform.dma_transfer_fixed_s``): a ring step is
one DMA. ``bw`` is the slowest link of the ring: ranks on one chip exchange through HBM at the
logical core's DMA rate; ranks on different chips share the chip's NeuronLink bandwidth among
the chip's logical cores. Ranks are assumed packed onto chips in rank order (torchrun's
``NEURON_RT_VISIBLE_CORES`` assignment).
"""

from __future__ import annotations

from .records import DeviceRecord

__all__ = ["collective_ns", "ring_bandwidth"]

_ALLREDUCE = {"allreduce", "allreduce_coalesced"}
_GATHER_LIKE = {"allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
                "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                "alltoall", "alltoall_base", "gather", "scatter"}
_TREE = {"broadcast", "reduce"}
_P2P = {"send", "recv", "recv_anysource"}


def ring_bandwidth(hw, ranks: list[int]) -> float:
    """Bytes/s of the slowest hop of a ring over ``ranks`` (global ranks)."""
    p = hw.platform
    per_chip = max(p.physical_cores_per_chip // hw.lnc, 1)
    chips = {r // per_chip for r in ranks} if ranks else {0}
    if len(chips) <= 1:
        return hw.dma_bw
    return p.neuronlink_bytes_per_s / per_chip


def collective_ns(rec: DeviceRecord, hw) -> float:
    """Estimated duration (ns) of a collective record (meta: op, group_size, ranks)."""
    m = rec.meta
    op = str(m.get("op", rec.name)).lower()
    n = int(m.get("group_size", 1) or 1)
    ranks = list(m.get("ranks") or range(n))
    nbytes = float(m.get("total_bytes", rec.bytes))
    alpha = hw.platform.dma_transfer_fixed_s
    if n <= 1:
        return alpha * 1e9
    bw = ring_bandwidth(hw, ranks)
    if op in _ALLREDUCE:
        t = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
    elif op in _GATHER_LIKE:
        t = (n - 1) / n * nbytes / bw + (n - 1) * alpha
    elif op in _TREE:
        t = nbytes / bw + (n - 1) * alpha
    elif op in _P2P:
        t = nbytes / bw + alpha
    elif op == "barrier":
        t = 2 * (n - 1) * alpha
    else:  # coalesced groups and unknown ops: all-reduce cost is the conservative choice
        t = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
    return t * 1e9
