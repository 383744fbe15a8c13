"""torch.neuron.set_sync_debug_mode: the operations that make the host wait for the device say so,
as torch.cuda.set_sync_debug_mode."""

import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def mode_off_after():
    yield
    torch.neuron.set_sync_debug_mode("default")


def x():
    return torch.tensor([1.0, -2.0, 3.0, 0.0], device="neuron")


def stream_synchronize():
    torch.neuron.current_stream().synchronize()


SYNCS = {
    "item": lambda: x().sum().item(),
    "bool": lambda: bool(x()[0] > 0),
    "cpu": lambda: x().cpu(),
    "to_cpu": lambda: x().to("cpu"),
    "tolist": lambda: x().tolist(),
    "repr": lambda: repr(x()),
    "nonzero": lambda: torch.nonzero(x()),
    "masked_select": lambda: torch.masked_select(x(), x() > 0),
    "unique": lambda: torch.unique(x()),
    "bool_index": lambda: x()[x() > 0],
    "bool_index_put": lambda: x().__setitem__(x() > 0, torch.tensor([5.0, 6.0], device="neuron")),
    "equal": lambda: torch.equal(x(), x()),
    "stream_synchronize": stream_synchronize,
}


def warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "synchronizing neuron operation" in str(w.message)]


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_host_wait_warns_in_warn_mode(name):
    torch.neuron.set_sync_debug_mode("warn")
    assert len(warnings_of(SYNCS[name])) >= 1


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_host_wait_raises_in_error_mode_and_the_device_stays_usable(name):
    torch.neuron.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match="called a synchronizing neuron operation"):
        SYNCS[name]()
    torch.neuron.set_sync_debug_mode(0)
    assert x().sum().item() == 2.0


def test_the_warning_names_the_operation():
    torch.neuron.set_sync_debug_mode(1)
    assert any("aten::nonzero" in m for m in warnings_of(lambda: torch.nonzero(x())))
    assert any("_local_scalar_dense" in m for m in warnings_of(lambda: x().max().item()))


def test_device_work_and_intended_waits_do_not_warn():
    """Queued ops, explicit device and event synchronization (a program that calls them means
    to wait, and CUDA does not warn for them either) and copies to the device."""
    a = x()
    torch.neuron.set_sync_debug_mode("warn")

    def work():
        b = (a * 2 + 1).relu().sum(0, keepdim=True)
        c = torch.ones(4).to("neuron") + b
        e = torch.neuron.Event()
        e.record()
        e.synchronize()
        torch.neuron.synchronize()
        return c

    assert warnings_of(work) == []


def test_nothing_is_reported_by_default():
    assert torch.neuron.get_sync_debug_mode() == 0
    for fn in SYNCS.values():
        assert warnings_of(fn) == []


def test_modes_by_name_and_number():
    for name, number in [("warn", 1), ("error", 2), ("default", 0), (2, 2), (0, 0)]:
        torch.neuron.set_sync_debug_mode(name)
        assert torch.neuron.get_sync_debug_mode() == number
    with pytest.raises(RuntimeError, match="invalid value of debug_mode"):
        torch.neuron.set_sync_debug_mode("loud")
    with pytest.raises(RuntimeError, match="invalid value of debug_mode"):
        torch.neuron.set_sync_debug_mode(3)
