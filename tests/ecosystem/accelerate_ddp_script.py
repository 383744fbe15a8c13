"""Launched by test_accelerate.py as ``accelerate launch --num_processes 2 accelerate_ddp_script.py
OUT``: an ordinary accelerate training script with no device code. Each rank writes what it
saw and the trained weights to ``OUT.<rank>.pt``."""

import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from accelerate_common import STEPS, make_loader, make_model


def main(out: str) -> None:
    acc = Accelerator()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, make_loader())
    losses = []
    for step, (x, y) in zip(range(STEPS), loader):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        losses.append(acc.gather(loss.detach()).cpu())
    # accelerate's neuron-specific object collectives (padded byte tensors on the device)
    objs = gather_object([{"rank": acc.process_index, "text": "x" * (10 + acc.process_index)}])
    shared = broadcast_object_list([f"from rank {acc.process_index}", acc.process_index])
    torch.save({
        "distributed_type": str(acc.distributed_type),
        "backend": acc.state.backend,
        "device": str(acc.device),
        "param_device": str(next(model.parameters()).device),
        "losses": torch.stack(losses),
        "state": {k: v.cpu() for k, v in acc.unwrap_model(model).state_dict().items()},
        "gathered": objs,
        "broadcast": shared,
    }, f"{out}.{acc.process_index}.pt")
    # Tear the process group down before interpreter exit, as accelerate scripts should: a rank
    # leaving with live DDP/c10d threads can abort at exit ("terminate called without an active
    # exception", seen once in a loaded full-suite run).
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
