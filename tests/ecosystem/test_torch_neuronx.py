"""``torch_neuronx``: AWS's import name, shipped by this project, and how the libraries that
look for it see the device."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import torchneuron
from support import REPO, run_python


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def test_importing_torch_neuronx_loads_the_backend_when_autoload_is_off():
    out = _ok(run_python(
        "import torch\n"
        "print(hasattr(torch, 'neuron'))\n"
        "import torch_neuronx\n"
        "print(torch.neuron.is_available(), torch.randn(2, device='neuron').device)\n",
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}))
    assert out == ["False", "True neuron:0"]


def test_import_torch_neuronx_stays_cheap():
    out = _ok(run_python(
        "import sys, torch_neuronx\n"
        "print(sorted({m.split('.')[1] for m in sys.modules\n"
        "              if m.startswith(('torch._dynamo', 'torch._inductor', 'torchneuron.nki'))}))\n"))
    assert out == ["[]"]


def test_version_is_torch_release_dot_build_version():
    import packaging.version
    import torch_neuronx

    torch_release = torch.__version__.split("+")[0]
    assert torch_neuronx.__version__ == f"{torch_release}.{torchneuron.__version__}"
    parts = torch_neuronx.__version__.split(".", 3)  # how optimum-neuron reads it
    assert len(parts) == 4 and ".".join(parts[:3]) == torch_release
    packaging.version.parse(parts[3])


def test_every_exported_name_is_torchneurons_object():
    import torch_neuronx
    from torchneuron.nki.torch_ops import nki_op

    expected = {
        "get_executed_ops": torchneuron.get_executed_ops,
        "get_fallback_ops": torchneuron.get_fallback_ops,
        "clear_op_tracking": torchneuron.clear_op_tracking,
        "Stream": torch.neuron.Stream, "Event": torch.neuron.Event,
        "memory_allocated": torch.neuron.memory_allocated,
        "memory_stats": torch.neuron.memory_stats,
        "empty_cache": torch.neuron.empty_cache,
        "nki_op": nki_op,
    }
    for name, obj in expected.items():
        assert getattr(torch_neuronx, name) is obj, name
    for name in torch_neuronx.__all__:
        assert getattr(torch_neuronx, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'xla_device'"):
        torch_neuronx.xla_device  # noqa: B018  (the XLA-era API is not provided)


def test_aws_dynamo_backend_module_path_is_the_neuron_backend():
    # (compiling with it is tests/compile's subject)
    import torch_neuronx.neuron_dynamo_backend as ndb
    from torch_neuronx.neuron_dynamo_backend.backend import neuron_backend

    from torchneuron.compile import neuron_backend as ours

    assert neuron_backend is ours and ndb.neuron_backend is ours


def test_packaging_installs_torch_neuronx_from_this_project_only():
    # Found from outside the checkout (through the installed project, not the working dir)...
    r = subprocess.run([sys.executable, "-c",
                        "import importlib.util; print(importlib.util.find_spec('torch_neuronx').origin)"],
                       capture_output=True, text=True, cwd="/", timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == os.path.join(REPO, "torch_neuronx", "__init__.py")
    # ... provided by the torchneuron distribution, and by no distribution of its own name.
    # (the editable install may list torchneuron twice: its dist-info and the checkout's egg-info)
    assert set(importlib.metadata.packages_distributions().get("torch_neuronx")) == {"torchneuron"}
    for name in ("torch-neuronx", "torch_neuronx"):
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.distribution(name)


# ---- what the libraries conclude ----------------------------------------------------------

def test_accelerate_detects_neuron_and_picks_its_device_and_backend():
    from accelerate.state import PartialState
    from accelerate.utils import is_neuron_available

    assert is_neuron_available() and is_neuron_available(check_device=True)
    assert PartialState().default_device == torch.device("neuron")


def test_transformers_detects_neuron_bf16_and_neuron_compile_backend():
    from transformers.utils import import_utils as iu

    assert iu.is_torch_neuron_available() and iu.is_torch_neuron_available(check_device=True)
    assert iu.is_torch_bf16_gpu_available()
    # The XLA-era check (torch_xla + torch_neuronx) stays False: transformers does not send
    # users to optimum-neuron's NeuronTrainer.
    assert not iu.is_torch_neuroncore_available()


def test_diffusers_and_optimum_style_probes_find_neuron():
    from diffusers.utils.torch_utils import get_device

    assert get_device() == "neuron"
    assert importlib.util.find_spec("torch_neuronx") is not None  # optimum's is_neuronx_available
