"""transformers tensor parallelism (``DistributedConfig(tp_plan="auto")``) under torchrun on
neuron: transformers maps the device to process-group backend ``neuron``, binds each rank to its
core and shards the weights as DTensors; logits equal the full model's on CPU."""

import os
import subprocess
import sys

import torch
from torch.testing import assert_close

from hf_support import tiny_llama

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tp_plan_auto_on_two_neuron_ranks_matches_cpu(tmp_path):
    model = tiny_llama(64).eval()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = model(ids).logits
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--standalone", os.path.join(HERE, "transformers_tp_script.py"),
                        str(tmp_path / "model"), str(tmp_path / "ids.pt"), str(tmp_path / "rank")],
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank.{rank}.pt")
        assert got["backend"] == "neuron" and got["device"] == f"neuron:{rank}"
        assert got["q_type"] == "DTensor" and got["q_local_rows"] == got["q_rows"] // 2
        assert_close(got["logits"], expected, atol=1e-5, rtol=1e-4)
