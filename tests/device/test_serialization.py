"""torch.save / torch.load of neuron tensors, map_location both ways, DLPack."""

import io

import pytest
import torch


def _round_trip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


def test_save_load_keeps_device_and_values():
    x = torch.randn(3, 4, device="neuron:1")
    y = _round_trip(x)
    assert y.device == torch.device("neuron:1")
    assert torch.equal(y.cpu(), x.cpu())


def test_state_dict_round_trip():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("neuron")
    sd = _round_trip(m.state_dict())
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("neuron")
    m2.load_state_dict(sd)
    x = torch.randn(5, 4, device="neuron")
    assert torch.equal(m(x).cpu(), m2(x).cpu())
    assert all(v.device.type == "neuron" for v in sd.values())


@pytest.mark.parametrize("location,expected", [("cpu", "cpu"), ("neuron:2", "neuron:2"),
                                               ({"neuron:0": "neuron:3"}, "neuron:3")])
def test_map_location_from_neuron(location, expected):
    x = torch.randn(5, device="neuron:0")
    y = _round_trip({"x": x}, map_location=location)["x"]
    assert str(y.device) == expected
    assert torch.equal(y.cpu(), x.cpu())


def test_map_location_cpu_to_neuron():
    x = torch.randn(5)
    y = _round_trip(x, map_location="neuron")
    assert y.device.type == "neuron" and torch.equal(y.cpu(), x)


def test_shared_storage_is_preserved():
    base = torch.arange(10.0, device="neuron")
    a, b = _round_trip([base[:5], base[5:]])
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_dlpack_round_trip_shares_memory():
    x = torch.arange(6.0, device="neuron")
    y = torch.from_dlpack(x)
    assert y.device == x.device and y.data_ptr() == x.data_ptr()
    z = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(x))
    z.add_(1)
    assert torch.equal(x.cpu(), torch.arange(6.0) + 1)
