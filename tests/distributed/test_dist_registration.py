"""register(): idempotent, cheap, and the backend is reachable by name and device."""

import subprocess
import sys


def test_register_is_idempotent_and_maps_device_to_backend():
    import torch.distributed as dist
    import torchneuron.distributed as tnd

    tnd.register()
    tnd.register()
    assert dist.Backend.backend_list.count("neuron") == 1
    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert tnd.is_registered()


def test_register_imports_no_heavy_distributed_modules():
    code = ("import sys, torch, torchneuron.distributed as d; d.register(); "
            "print([m for m in ('torch.distributed.tensor', 'torch.distributed.fsdp', "
            "'torch.distributed.pipelining', 'torch._dynamo') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert "Overriding a previously registered kernel" not in out.stderr


def _bind(env_extra, code):
    import os

    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", "import torch, torchneuron.distributed as d\n" + code],
                          env=env, capture_output=True, text=True, timeout=60)


def test_local_rank_binds_process_to_its_core():
    out = _bind({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"},
                "print(d.bind_local_device(), torch.neuron.current_device())")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3"]


def test_memory_on_another_core_before_init_is_a_clear_error():
    out = _bind({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                "x = torch.ones(4, device='neuron:0')\nd.bind_local_device()")
    assert out.returncode != 0
    assert "already holds memory on neuron:0" in out.stderr and "LOCAL_RANK=1" in out.stderr


def test_more_processes_than_cores_is_a_clear_error():
    out = _bind({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}, "d.bind_local_device()")
    assert out.returncode != 0
    assert "8 processes per node but only 4" in out.stderr
