"""PyTorch 2.13 places that decide by device name whether a feature applies: neuron is on each
list it belongs to (the audit with status is in docs/architecture.md, "Device allow-lists")."""

import torch


def test_optimizer_foreach_fused_and_capturable_lists_include_neuron():
    from torch.optim.optimizer import _get_capturable_supported_devices
    from torch.utils._foreach_utils import (_get_foreach_kernels_supported_devices,
                                            _get_fused_kernels_supported_devices)

    assert "neuron" in _get_foreach_kernels_supported_devices()
    assert "neuron" in _get_fused_kernels_supported_devices()
    assert "neuron" in _get_capturable_supported_devices()


def test_default_optimizer_implementation_on_neuron_is_foreach():
    from torch.optim.optimizer import _default_to_fused_or_foreach

    p = torch.zeros(2, device="neuron", requires_grad=True)
    assert _default_to_fused_or_foreach([p], differentiable=False, use_fused=False) == (False, True)


def test_available_device_type_and_device_module_are_neurons():
    assert torch._utils._get_available_device_type() == "neuron"
    assert torch.get_device_module("neuron") is torch.neuron
    assert torch._utils._get_device_index(torch.device("neuron"), optional=True) == torch.neuron.current_device()


def test_amp_autocast_and_grad_scaler_accept_neuron():
    assert torch.amp.is_autocast_available("neuron")
    scaler = torch.amp.GradScaler("neuron")
    assert scaler.is_enabled()
    w = torch.ones(2, device="neuron", requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale((w * 3).sum()).backward()
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(w.detach().cpu(), torch.full((2,), -2.0))


def test_fsdp_sharded_grad_scaler_supports_neuron_tensors():
    from torch.distributed.fsdp.sharded_grad_scaler import _is_supported_device

    assert _is_supported_device(torch.zeros(1, device="neuron"))


def test_distributed_default_backend_for_neuron_is_neuron():
    import torch.distributed as dist

    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert "neuron" in dist.Backend.backend_capability["neuron"]


def test_dataloader_pin_memory_pins_for_the_neuron_accelerator():
    from torch.utils.data import DataLoader, TensorDataset

    (batch,) = next(iter(DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2, pin_memory=True)))
    assert batch.is_pinned()
    assert batch.to("neuron", non_blocking=True).device.type == "neuron"


def test_activation_checkpoint_infers_the_neuron_device_for_rng_state():
    from torch.utils.checkpoint import _infer_device_type

    assert _infer_device_type(torch.zeros(1, device="neuron")) == "neuron"
