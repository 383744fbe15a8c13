"""TorchTitan 0.2.2's Llama 3 debug model on neuron through examples/torchtitan/run.sh: FSDP2 on
2 ranks, ``torch.compile`` (TorchTitan's default Inductor backend), a few steps.

The oracle: the run starts from weights written here on CPU (TorchTitan's
``--checkpoint.initial_load_path``, a DCP checkpoint), so its first logged loss and gradient
norm (before any update) must equal the same model's on CPU over the same two ranks' batches,
taken from TorchTitan's own data loader."""

import os
import re
import subprocess
import sys

import torch
import torch.nn.functional as F

from support import REPO

EXAMPLE = os.path.join(REPO, "examples", "torchtitan")
TOML = os.path.join(EXAMPLE, "llama3_debug_neuron.toml")
STEPS = 3
FP32 = ["--training.mixed_precision_param", "float32"]  # compare with CPU fp32 tightly


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


def test_llama3_debug_fsdp2_compiled_on_two_neuron_ranks_matches_cpu(tmp_path):
    from torch.distributed.checkpoint import save

    triton_dir = os.path.join(REPO, ".venv", "torchtitan-triton", "triton")
    assert os.path.isdir(triton_dir), (
        "TorchTitan 0.2.2 imports triton: run `make test` (or `make .venv/torchtitan-triton/.stamp`)")

    work = str(tmp_path)
    subprocess.run([sys.executable, os.path.join(EXAMPLE, "prepare_assets.py"), f"{work}/assets"],
                   check=True, capture_output=True, timeout=120)
    jc = _job_config(work)
    spec, model = _cpu_model(jc)
    save(model.state_dict(), checkpoint_id=f"{work}/seed")  # no process group: one writer

    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    r = subprocess.run(
        ["bash", os.path.join(EXAMPLE, "run.sh"), work, f"--training.steps={STEPS}", *FP32,
         "--checkpoint.enable", f"--checkpoint.initial_load_path={work}/seed",
         "--checkpoint.initial_load_model_only", f"--checkpoint.folder={work}/ckpt",
         "--metrics.disable_color_printing"],
        capture_output=True, text=True, env=env, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    assert "Compiling each TransformerBlock with torch.compile" in log
    assert re.search(r"Applied FSDP to the model", log), log[-3000:]
    steps = {}  # every rank logs the global values
    for m in re.finditer(r"step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+)", log):
        steps[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    assert sorted(steps) == list(range(1, STEPS + 1)), log[-3000:]

    loss, norm = _cpu_first_step(spec, model, jc)
    assert abs(steps[1][0] - loss) < 2e-4, (steps[1], loss)
    assert abs(steps[1][1] - norm) < 2e-3 * norm + 1e-4, (steps[1], norm)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in steps.values())
