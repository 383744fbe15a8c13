"""Autoload: `import torch` alone makes neuron usable; the switch turns it off; nothing heavy."""

from support import run_python


def test_import_torch_alone_makes_neuron_usable():
    r = run_python("import torch; x = torch.ones(2, device='neuron'); print(x.device, torch.neuron.device_count())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["neuron:0", "4"]


def test_autoload_env_switch_disables_it():
    r = run_python("import torch; print(hasattr(torch, 'neuron'))", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_import_torchneuron_registers_without_autoload():
    r = run_python("import torchneuron, torch; print(torch.zeros(1, device='neuron').device)",
                   env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "neuron:0"


def test_import_torchneuron_first_works():
    r = run_python("import torchneuron; import torch; print(torch.zeros(1, device='neuron').device)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "neuron:0"


def test_autoload_imports_no_compiler_and_initialises_nothing():
    r = run_python("import sys, torch; print(any(m.startswith(('torch._dynamo', 'torch._inductor')) "
                   "for m in sys.modules), torch.neuron.is_initialized())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_tensor_and_module_methods_are_generated():
    r = run_python("import torch; t = torch.ones(1).neuron(); m = torch.nn.Linear(2, 2).neuron(); "
                   "print(t.is_neuron, m.weight.device, t.untyped_storage().is_neuron)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "neuron:0", "True"]
