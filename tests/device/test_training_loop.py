"""An unmodified CUDA-style training loop whose only change is the device string, and the
demo model, train identically on neuron and CPU."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import GPT, CharDataset, GPTConfig  # noqa: E402


def cuda_style_training(device: str, steps: int = 5):
    """Written as for CUDA: `device = "cuda"` would be the only difference."""
    torch.manual_seed(0)
    # Dropout stays in the loop but with p=0: neuron's masks come from its Philox generator and
    # differ from CPU's by design, as CUDA's do (dropout itself: tests/device/test_random.py).
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Dropout(0.0),
                                torch.nn.Linear(4 * 4 * 4, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, pin_memory=True)
    losses = []
    model.train()
    for step, (x, y) in zip(range(steps), loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    if device != "cpu":
        torch.accelerator.synchronize()
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


def test_cuda_style_loop_runs_unchanged_and_matches_cpu():
    cpu_losses, cpu_state = cuda_style_training("cpu")
    dev_losses, dev_state = cuda_style_training("neuron")
    torch.testing.assert_close(dev_losses, cpu_losses, atol=1e-5, rtol=1e-4)
    for k in cpu_state:
        torch.testing.assert_close(dev_state[k], cpu_state[k], atol=1e-5, rtol=1e-4, msg=k)


def test_demo_gpt_trains_identically_on_neuron_and_cpu():
    def run(device):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=1, n_embd=32, block_size=16)
        model = GPT(cfg).to(device)
        # foreach=False on both: AdamW picks different defaults for PrivateUse1 and CPU.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        data = CharDataset(block_size=16)
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(4):
            x, y = data.batch(4, gen)
            _, loss = model(x.to(device), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.testing.assert_close(run("neuron"), run("cpu"), atol=1e-5, rtol=1e-5)


def test_accelerator_api_selects_neuron():
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator() == torch.device("neuron")
    assert torch.accelerator.device_count() == torch.neuron.device_count()
    torch.accelerator.set_device_index(1)
    assert torch.accelerator.current_device_index() == 1
    torch.accelerator.set_device_index(0)
