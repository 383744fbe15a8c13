"""The execution engine's executor thread (torch.neuron.engine.set_executor_thread_enabled):
queued kernels run on a thread of their own while the host runs ahead. Everything the host
observes at a synchronization point is what it observes without it (compared with CPU PyTorch,
or with the engine running the queues on the host thread)."""

from __future__ import annotations

import sys
import os
import time

import pytest
import torch

from support import run_python
from torchneuron.compile import eager_fusion

engine = torch.neuron.engine
BIG = 1 << 22


@pytest.fixture(autouse=True)
def executor():
    was, was_thread, was_fusing = engine.is_enabled(), engine.is_executor_thread_enabled(), engine.is_fusion_enabled()
    engine.set_enabled(True)
    engine.set_executor_thread_enabled(True)
    yield
    try:
        torch.neuron.synchronize()
    finally:
        engine.set_executor_thread_enabled(was_thread)
        engine.set_fusion_enabled(was_fusing)
        engine.set_enabled(was)


def executed_without_waiting(timeout: float = 30.0) -> bool:
    """Whether every enqueued kernel completes while the host only sleeps (no host wait). With
    fusion on a trailing run of fusible kernels would wait for the kernel that ends it: the
    callers turn fusion off."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["executed"] == s["enqueued"]:
            return True
        time.sleep(0.001)
    return False


def test_queued_kernels_run_without_a_host_wait():
    engine.set_fusion_enabled(False)
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    drains = engine.stats()["drains"]
    for _ in range(10):
        x.mul_(1.0001)
    assert executed_without_waiting()
    assert engine.stats()["drains"] == drains  # nobody waited: the executor ran them
    assert torch.equal(x.cpu(), torch.ones(BIG).mul_(1.0001).mul_(1.0001).mul_(1.0001).mul_(1.0001).mul_(1.0001)
                       .mul_(1.0001).mul_(1.0001).mul_(1.0001).mul_(1.0001).mul_(1.0001))


def test_the_host_runs_ahead_of_the_executor():
    x = torch.ones(BIG, device="neuron")
    torch.neuron.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        x.mul_(1.0001)
    enqueued = time.perf_counter()
    torch.neuron.synchronize()
    done = time.perf_counter()
    assert enqueued - start < done - enqueued  # the 20 passes ran after the loop returned


def test_a_training_step_matches_the_engine_without_the_thread_bit_for_bit():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from engine import mlp_model  # bench/engine.py (d): linear, layer norm, GELU, AdamW

    def train():
        model = mlp_model("neuron")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)).to("neuron")
        losses = []
        for _ in range(4):
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [l.item() for l in losses], [p.detach().cpu() for p in model.parameters()]

    with_thread = train()
    engine.set_executor_thread_enabled(False)
    without = train()
    assert with_thread[0] == without[0]
    assert all(torch.equal(a, b) for a, b in zip(with_thread[1], without[1]))


def test_a_mixed_sequence_on_two_streams_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 64, generator=gen), torch.randn(64, 32, generator=gen)
    na, nb = a.to("neuron"), b.to("neuron")
    side = torch.neuron.Stream()
    with torch.neuron.stream(side):
        nc = (na @ nb).relu_()
    torch.neuron.current_stream().wait_stream(side)
    nd = torch.softmax(nc * 0.5 + 1, dim=-1).sum(0)
    want = torch.softmax((a @ b).relu_() * 0.5 + 1, dim=-1).sum(0)
    assert torch.equal(nd.cpu(), want)


def test_a_kernel_error_surfaces_at_the_next_synchronization_and_the_device_stays_usable():
    w = torch.arange(4, device="neuron")
    w.remainder_(torch.tensor([1, 2, 0, 3], device="neuron"))  # fails in the kernel, on the executor
    line = sys._getframe().f_lineno - 1
    with pytest.raises(RuntimeError) as err:
        torch.neuron.synchronize()
    assert "remainder" in str(err.value) and f'{__file__}", line {line}' in str(err.value)
    torch.neuron.synchronize()  # reported once
    assert (torch.ones(3, device="neuron") * 2).sum().item() == 6.0


def test_polling_a_stream_finishes_with_a_fusible_run_left_queued():
    # The executor leaves a trailing run of fusible kernels queued (it may still grow into a
    # region); a loop polling the stream must still see it complete.
    engine.set_fusion_enabled(True)
    x = torch.ones(4096, device="neuron")
    for _ in range(5):
        x.mul_(2.0).add_(1.0)
    deadline = time.monotonic() + 30
    while not torch.neuron.current_stream().query():
        assert time.monotonic() < deadline, "the stream never became idle"
    assert torch.equal(x.cpu(), torch.full((4096,), 63.0))


def test_regions_do_not_depend_on_when_the_executor_catches_up(monkeypatch):
    # With fusion on, the executor takes a run of fusible kernels only once a non-fusible kernel
    # (or a host wait) ends it: one signature however the timing falls.
    engine.set_fusion_enabled(True)
    seen = []
    monkeypatch.setattr(eager_fusion, "request", lambda sigs: seen.extend(sigs))  # nothing compiles
    w = torch.rand(64, 64, device="neuron")
    x = torch.rand(64, 64, device="neuron")
    for i in range(50):
        y = x @ w
        y.add_(0.5).mul_(x)  # (no other test's sequence)
        if i % 7 == 0:
            time.sleep(0.002)  # let the executor catch up in the middle of the run
        y.sub_(x, alpha=0.5).div_(3.0).lerp_(x, 0.25)
    torch.neuron.synchronize()
    assert len(set(seen)) == 1, [list(s) for s in set(seen)]


def test_the_host_threads_intra_op_setting_is_its_own():
    engine.set_fusion_enabled(False)
    threads = torch.get_num_threads()
    x = torch.randn(512, 512, device="neuron")
    for _ in range(5):
        x = x @ x.t() / 512
    assert executed_without_waiting()
    assert torch.get_num_threads() == threads  # the executor's single thread is its own


def test_environment_turns_the_executor_thread_on():
    r = run_python("import torch; import torchneuron; print(torch.neuron.engine.is_executor_thread_enabled())",
                   env={"TORCHNEURON_EXECUTOR_THREAD": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "True"
