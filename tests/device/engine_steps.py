"""Shared by the engine's tests: training steps asserted to make no host wait."""

from __future__ import annotations

import torch

__all__ = ["trains_without_waiting"]


def trains_without_waiting(loss_fn, opt, steps=2):
    """`steps` training steps (loss_fn(), backward, opt.step()), each asserted to make no host
    wait (the second has optimizer state); returns the kernels each step enqueued."""
    enqueued = []
    for _ in range(steps):
        torch.neuron.synchronize()
        before = torch.neuron.engine.stats()
        loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        after = torch.neuron.engine.stats()
        assert after["drains"] == before["drains"], "the step waited for the device"
        enqueued.append(after["enqueued"] - before["enqueued"])
    return enqueued
