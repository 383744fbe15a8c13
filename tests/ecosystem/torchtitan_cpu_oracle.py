"""Run by test_torchtitan.py in its own interpreter (TorchTitan imports triton, which is on the
path of TorchTitan processes only): writes the seed checkpoint the run starts from, and the CPU
oracle of the run's first step, to WORK. Usage: python torchtitan_cpu_oracle.py WORK"""

import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
TOML = os.path.join(HERE, "..", "..", "examples", "torchtitan", "llama3_debug_neuron.toml")
FP32 = ["--training.mixed_precision_param", "float32"]


def _job_config(work):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args([
        "--job.config_file", TOML, "--model.hf_assets_path", f"{work}/assets/tokenizer",
        "--training.dataset_path", f"{work}/assets/c4_test", *FP32])


def _cpu_model(jc):
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(jc.model.name)
    args = copy.deepcopy(spec.model_args[jc.model.flavor])
    args.update_from_config(jc)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return spec, model


def _cpu_first_step(spec, model, jc):
    """Loss and gradient norm of TorchTitan's first step, computed on CPU: the two ranks'
    first batches together, cross-entropy summed and divided by the global token count."""
    tok = spec.build_tokenizer_fn(jc)
    inputs, labels = [], []
    for rank in range(2):
        batch, lab = next(iter(spec.build_dataloader_fn(dp_world_size=2, dp_rank=rank,
                                                        tokenizer=tok, job_config=jc)))
        inputs.append(batch["input"])
        labels.append(lab)
    inputs, labels = torch.cat(inputs), torch.cat(labels)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=-100) / (labels != -100).sum()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return loss.item(), norm.item()



def main(work: str) -> None:
    from torch.distributed.checkpoint import save

    jc = _job_config(work)
    spec, model = _cpu_model(jc)
    save(model.state_dict(), checkpoint_id=f"{work}/seed")  # no process group: one writer
    loss, norm = _cpu_first_step(spec, model, jc)
    with open(f"{work}/oracle.json", "w") as f:
        json.dump({"loss": loss, "grad_norm": norm}, f)


if __name__ == "__main__":
    main(sys.argv[1])
