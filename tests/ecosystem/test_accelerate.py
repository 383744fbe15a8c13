"""accelerate on neuron with no device code: single process (fp32, bf16 autocast) and
``accelerate launch`` with 2 processes (DDP over the ``neuron`` process group), each compared
with the same library on CPU."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from accelerate_common import BATCH, STEPS, make_data, make_loader, make_model
from hf_support import reset_accelerate_state

HERE = os.path.dirname(os.path.abspath(__file__))


def _train(mixed_precision: str, cpu: bool):
    from accelerate import Accelerator

    reset_accelerate_state()
    acc = Accelerator(mixed_precision=mixed_precision, cpu=cpu)
    model, opt, loader = acc.prepare(make_model(), None, make_loader())
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for _, (x, y) in zip(range(STEPS), loader):
        opt.zero_grad()
        with acc.autocast():
            loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        losses.append(loss.item())
    return acc, model, losses


@pytest.mark.parametrize("mixed_precision,tol", [("no", 1e-5), ("bf16", 2e-2)])
def test_single_process_training_runs_on_neuron_and_matches_cpu(fresh_accelerate_state, mixed_precision, tol):
    acc, model, losses = _train(mixed_precision, cpu=False)
    assert acc.device.type == "neuron"  # single process: torch.device("neuron"), as for CUDA
    assert next(model.parameters()).device.type == "neuron"
    _, ref_model, ref_losses = _train(mixed_precision, cpu=True)
    assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=tol, rtol=tol)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_close(p.detach().cpu(), q.detach(), atol=tol, rtol=tol)


def test_bf16_autocast_context_is_neurons(fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="bf16")
    with acc.autocast():
        y = torch.nn.functional.linear(torch.randn(2, 4, device="neuron"),
                                       torch.randn(3, 4, device="neuron"))
        assert torch.is_autocast_enabled("neuron")
        assert torch.get_autocast_dtype("neuron") == torch.bfloat16
    assert y.dtype == torch.bfloat16


def test_save_and_load_state_round_trip_neuron_rng_and_weights(fresh_accelerate_state, tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    acc = Accelerator()
    model = acc.prepare(make_model())
    set_seed(123)  # seeds torch.neuron too
    acc.save_state(str(tmp_path))
    first = torch.rand(4, device="neuron").cpu()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(str(tmp_path))
    assert_close(torch.rand(4, device="neuron").cpu(), first)  # neuron RNG state restored
    for p, q in zip(model.parameters(), make_model().parameters()):
        assert_close(p.detach().cpu(), q.detach())


def test_release_memory_empties_the_neuron_cache(fresh_accelerate_state):
    from accelerate.utils import release_memory

    before = torch.neuron.memory_reserved()
    x = torch.empty(8 << 20, device="neuron")  # 32 MiB: a segment of its own
    del x
    cached = torch.neuron.memory_reserved()
    assert cached >= before + (32 << 20)
    release_memory()  # accelerate's neuron branch: torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() <= before


def test_accelerate_launch_two_processes_trains_ddp_over_neuron_like_cpu(tmp_path):
    out = str(tmp_path / "rank")
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    # No --multi_gpu and no config: accelerate sees 2+ neuron devices and enables DDP itself.
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                        "--main_process_port", "0", os.path.join(HERE, "accelerate_ddp_script.py"), out],
                       capture_output=True, text=True, env=env, timeout=240, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-4000:]
    ranks = [torch.load(f"{out}.{i}.pt", weights_only=False) for i in range(2)]

    # CPU oracle: one process over the global batch (rank 0 takes batch 2s, rank 1 batch 2s+1).
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x_all, y_all = make_data()
    ref_losses = []
    for s in range(STEPS):
        sl = slice(2 * BATCH * s, 2 * BATCH * (s + 1))
        opt.zero_grad()
        per_rank = [F.mse_loss(ref(x_all[sl][i * BATCH:(i + 1) * BATCH]), y_all[sl][i * BATCH:(i + 1) * BATCH])
                    for i in range(2)]
        (sum(per_rank) / 2).backward()
        opt.step()
        ref_losses.append(torch.stack([l.detach() for l in per_rank]))

    for i, got in enumerate(ranks):
        assert got["distributed_type"] == "DistributedType.MULTI_NEURON"
        assert got["backend"] == "neuron"
        assert got["device"] == got["param_device"] == f"neuron:{i}"
        assert_close(got["losses"], torch.stack(ref_losses), atol=1e-5, rtol=1e-5)
        for k, v in ref.state_dict().items():
            assert_close(got["state"][k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
        assert got["gathered"] == [{"rank": 0, "text": "x" * 10}, {"rank": 1, "text": "x" * 11}]
        assert got["broadcast"] == ["from rank 0", 0]


def test_accelerate_env_reports_the_neuron_accelerator(capsys):
    from accelerate.commands.env import env_command, env_command_parser

    env_command(env_command_parser().parse_args([]))
    out = capsys.readouterr().out
    assert "- PyTorch accelerator: NEURON" in out, out
    assert f"- NEURON type: {torch.neuron.get_device_name()}" in out, out
