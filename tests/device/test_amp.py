"""torch.autocast("neuron") with CUDA's op policies; GradScaler("neuron")."""

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmul_family_runs_in_lower_precision(dtype):
    a = torch.randn(8, 8, device="neuron")
    lin = torch.nn.Linear(8, 4).to("neuron")
    with torch.autocast("neuron", dtype=dtype):
        assert (a @ a).dtype == dtype
        assert torch.mm(a, a).dtype == dtype
        assert lin(a).dtype == dtype
        assert torch.bmm(a[None], a[None]).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_policy_ops_upcast(dtype):
    x = torch.randn(4, 4, device="neuron").to(dtype)
    with torch.autocast("neuron", dtype=dtype):
        assert torch.softmax(x, 0).dtype == torch.float32
        assert torch.nn.functional.mse_loss(x, x).dtype == torch.float32
        assert torch.exp(x).dtype == torch.float32  # exp is on CUDA's fp32 list
        assert torch.relu(x).dtype == dtype  # not on a list: unchanged


def test_promote_policy_widest_type():
    a = torch.randn(3, device="neuron", dtype=torch.bfloat16)
    b = torch.randn(3, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        assert torch.addcmul(a, a, b).dtype == torch.float32


def test_autocast_results_match_cpu_autocast():
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = a @ b
    with torch.autocast("neuron", dtype=torch.bfloat16):
        got = a.to("neuron") @ b.to("neuron")
    assert torch.equal(got.cpu(), expected)


def test_binary_cross_entropy_is_banned_like_on_cuda():
    p = torch.rand(4, device="neuron")
    with torch.autocast("neuron", dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        torch.nn.functional.binary_cross_entropy(p, p)


def test_autocast_disabled_region_and_neuron_amp_alias():
    a = torch.randn(4, 4, device="neuron")
    with torch.neuron.amp.autocast(dtype=torch.bfloat16):
        with torch.autocast("neuron", enabled=False):
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.bfloat16
    assert torch.neuron.get_amp_supported_dtype() == [torch.float16, torch.bfloat16, torch.float32]
    assert torch.neuron.is_bf16_supported()


def test_grad_scaler_trains_and_skips_inf_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron", init_scale=2.0**8)
    x, y = torch.randn(16, 4, device="neuron"), torch.randn(16, 1, device="neuron")
    losses = []
    for _ in range(5):
        opt.zero_grad()
        with torch.autocast("neuron", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # An inf gradient makes the scaler skip the step and halve the scale.
    w = model.weight.detach().clone()
    opt.zero_grad()
    scale = scaler.get_scale()
    scaler.scale(model(x).sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight.detach().cpu(), w.cpu())
    assert scaler.get_scale() == scale * 0.5
