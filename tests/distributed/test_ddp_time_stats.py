"""DDP's time statistics on neuron (``model._get_ddp_logging_data()``) come from the device's
c10d::Timer (csrc/distributed/ddp_timer.cpp), recorded with device events."""

import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

DEV = "neuron"
SLEEP_S = 0.05


class SlowForward(nn.Module):
    """Forward takes at least SLEEP_S between DDP's forward-start and backward-start events."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        time.sleep(SLEEP_S)
        return self.fc(x)


def case_ddp_reports_device_time_stats(rank, size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(SlowForward().to(DEV))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # stats are collected every few iterations, starting with the first
            x = torch.randn(8, 64, device=DEV)
            # The times are the device's: the host's sleep shows in the forward's time only if
            # the device is idle when the forward starts (not still running the last backward's
            # or the constructor's queued work).
            torch.neuron.synchronize()
            model(x).sum().backward()
    assert not [w for w in caught if "Time stats" in str(w.message)], [str(w.message) for w in caught]
    stats = model._get_ddp_logging_data()
    assert stats["avg_forward_compute_time"] >= SLEEP_S * 1e9, stats
    assert stats["avg_backward_compute_time"] > 0, stats
    assert stats["avg_backward_comm_time"] > 0, stats
    # Communication starts after the backward started and ends after it ended.
    assert stats["avg_backward_compute_comm_overlap_time"] >= 0, stats


def test_ddp_reports_device_time_stats(world2): world2.run(case_ddp_reports_device_time_stats)
