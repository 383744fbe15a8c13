"""Train a small GPT on the emulated Trainium device — the main demo (``make demo``).

How to read it: the only device-specific line is picking the device through
``torch.accelerator``; everything else is ordinary PyTorch (which is the point). On a machine
with torchneuron installed, ``torch.accelerator.current_accelerator()`` is ``neuron``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, CharDataset, GPTConfig, lr_at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default=None, help="default: torch.accelerator.current_accelerator()")
    args = ap.parse_args()

    # 1. The device: whatever accelerator PyTorch found (neuron here), else CPU.
    device = torch.device(args.device) if args.device else (
        torch.accelerator.current_accelerator() or torch.device("cpu"))
    torch.manual_seed(0)

    # 2. Model, data and optimizer, exactly as on any device.
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    data = CharDataset(block_size=cfg.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console()
    name = torch.neuron.get_device_name(device) if device.type == "neuron" else str(device)
    console.print(f"[bold]Training GPT[/bold] ({model.num_params() / 1e6:.2f} M params) on "
                  f"[cyan]{device}[/cyan]: {name}")

    tokens_per_step = args.batch_size * cfg.block_size
    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeRemainingColumn(), console=console, transient=False) as progress:
        task = progress.add_task("train", total=args.steps, info="")
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            x, y = data.batch(args.batch_size, gen)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 10 == 0 or step == args.steps - 1:
                torch.accelerator.synchronize()
                elapsed = time.perf_counter() - start
                mem = ""
                if device.type != "cpu":
                    mem = (f" | mem {torch.accelerator.memory_allocated() / 2**20:.1f} MiB"
                           f" (peak {torch.accelerator.max_memory_allocated() / 2**20:.1f})")
                progress.update(task, info=f"loss {loss.item():.3f} | "
                                f"{tokens_per_step * (step + 1) / elapsed:,.0f} tok/s{mem}")
            progress.advance(task)

    elapsed = time.perf_counter() - start
    model.eval()
    prompt = torch.tensor([[ord(c) - 31 for c in "It was the "]], device=device)
    sample = CharDataset.decode(model.generate(prompt, 40, temperature=0.8)[0].tolist())
    console.print(f"final loss {loss.item():.3f}; {args.steps} steps in {elapsed:.1f} s "
                  f"({tokens_per_step * args.steps / elapsed:,.0f} tokens/s)")
    console.print(f"sample: [green]{sample!r}[/green]")
    if device.type == "neuron":
        console.print(torch.neuron.memory_summary(device, abbreviated=True))


if __name__ == "__main__":
    main()
