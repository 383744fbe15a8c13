"""TorchTitan 0.2.2's Llama 3 debug model on neuron through examples/torchtitan/run.sh: FSDP2 on
2 ranks, ``torch.compile`` (TorchTitan's default Inductor backend), a few steps.

The oracle: the run starts from weights written here on CPU (TorchTitan's
``--checkpoint.initial_load_path``, a DCP checkpoint), so its first logged loss and gradient
norm (before any update) must equal the same model's on CPU over the same two ranks' batches,
taken from TorchTitan's own data loader."""

import json
import os
import re
import subprocess
import sys

import torch

from support import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(REPO, "examples", "torchtitan")
STEPS = 3
FP32 = ["--training.mixed_precision_param", "float32"]  # compare with CPU fp32 tightly


def test_llama3_debug_fsdp2_compiled_on_two_neuron_ranks_matches_cpu(tmp_path):
    triton_dir = os.path.join(REPO, ".venv", "torchtitan-triton")
    assert os.path.isdir(os.path.join(triton_dir, "triton")), (
        "TorchTitan 0.2.2 imports triton: run `make test` (or `make .venv/torchtitan-triton/.stamp`)")

    work = str(tmp_path)
    subprocess.run([sys.executable, os.path.join(EXAMPLE, "prepare_assets.py"), f"{work}/assets"],
                   check=True, capture_output=True, timeout=120)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    oracle_env = dict(env, PYTHONPATH=os.pathsep.join(
        [triton_dir, HERE] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    o = subprocess.run([sys.executable, os.path.join(HERE, "torchtitan_cpu_oracle.py"), work],
                       capture_output=True, text=True, timeout=300, env=oracle_env)
    assert o.returncode == 0, o.stderr[-4000:]
    with open(f"{work}/oracle.json") as f:
        oracle = json.load(f)

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

    loss, norm = oracle["loss"], oracle["grad_norm"]
    assert abs(steps[1][0] - loss) < 2e-4, (steps[1], loss)
    assert abs(steps[1][1] - norm) < 2e-3 * norm + 1e-4, (steps[1], norm)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in steps.values())
