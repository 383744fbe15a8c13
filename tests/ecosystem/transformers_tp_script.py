"""Launched by test_transformers_tp.py with torchrun (2 processes): an ordinary transformers
tensor-parallel load, no device code. transformers initialises torch.distributed itself with its
``neuron`` -> ``"neuron"`` backend mapping. Each rank saves what it saw to ``OUT.<rank>.pt``."""

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig


def main(model_dir: str, ids_file: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir,
                                                 distributed_config=DistributedConfig(tp_plan="auto"))
    ids = torch.load(ids_file)
    with torch.no_grad():
        logits = model(ids.to(model.device)).logits
    q = model.model.layers[0].self_attn.q_proj.weight
    torch.save({"backend": dist.get_backend(), "device": str(model.device),
                "q_type": type(q).__name__, "q_local_rows": q.to_local().shape[0],
                "q_rows": q.shape[0], "logits": logits.float().cpu()},
               f"{out}.{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
