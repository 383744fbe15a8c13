"""torchao on neuron: float8 training (``convert_to_float8_training``, dynamic tensorwise
scaling) and int8 weight-only quantization, each against the same torchao path on CPU."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _float8_steps(model, device, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_float8_training_on_neuron_matches_cpu():
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    ref = convert_to_float8_training(_mlp())
    dev = convert_to_float8_training(_mlp().to("neuron"))
    assert all(isinstance(m, Float8Linear) for m in (dev[0], dev[2]))
    ref_losses = _float8_steps(ref, "cpu")
    assert_close(torch.tensor(_float8_steps(dev, "neuron")), torch.tensor(ref_losses),
                 atol=1e-5, rtol=1e-4)
    for p, q in zip(dev.parameters(), ref.parameters()):
        assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4)
    # float8 is really in play: the high-precision model trains differently
    assert abs(_float8_steps(_mlp(), "cpu")[-1] - ref_losses[-1]) > 1e-5


def test_int8_weight_only_on_neuron_matches_cpu():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    ref, dev = _mlp(), _mlp().to("neuron")
    quantize_(ref, Int8WeightOnlyConfig())
    quantize_(dev, Int8WeightOnlyConfig())
    w = dev[0].weight
    assert w.device.type == "neuron" and type(w).__name__ != "Parameter"
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = dev(x.to("neuron"))
        expected = ref(x)
        assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)
        assert (expected - _mlp()(x)).abs().max() > 1e-4  # quantization changed the outputs
