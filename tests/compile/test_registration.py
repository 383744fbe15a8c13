"""Backend registration and code generation shape."""

import importlib.metadata

import torch
from torch._inductor.utils import run_and_get_code

from compile_models import DEV
from support import run_python


def _entry_point_installed() -> bool:
    return any(ep.name == "neuron" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"))


def test_backend_is_listed():
    assert "neuron" in torch.compiler.list_backends()


def test_dynamo_backend_entry_point_is_installed():
    assert _entry_point_installed()


def test_entry_point_compiles_after_plain_import_torch():
    r = run_python(
        "import torch, sys\n"
        "assert 'torchneuron.compile.backend' not in sys.modules\n"
        "f = torch.compile(lambda x: (x * 2).sin(), backend='neuron')\n"
        "x = torch.randn(8, device='neuron')\n"
        "torch.testing.assert_close(f(x).cpu(), (x.cpu() * 2).sin())\n"
        "print(torch.neuron.get_dynamo_metrics()['compilations'])\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "1"


def test_import_torch_does_not_load_dynamo_or_inductor():
    r = run_python("import sys, torch, torchneuron.compile\n"
                   "print(any(m.startswith(('torch._dynamo', 'torch._inductor')) for m in sys.modules))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_set_default_backend_routes_plain_compile(metrics):
    torch.compiler.set_default_backend("neuron")
    try:
        f = torch.compile(lambda x: x.cos() + 1)
        x = torch.randn(16, device=DEV)
        torch.testing.assert_close(f(x).cpu(), x.cpu().cos() + 1)
    finally:
        torch.compiler.set_default_backend(None)
    assert metrics()["compilations"] == 1


def test_pointwise_chain_is_one_fused_kernel_on_neuron_buffers():
    def f(x, y):
        return ((x * y).sin() + 1).relu().exp() * 0.5

    x, y = torch.randn(64, 64, device=DEV), torch.randn(64, 64, device=DEV)
    out, (code,) = run_and_get_code(torch.compile(f, backend="neuron"), x, y)
    assert out.device == DEV
    torch.testing.assert_close(out.cpu(), f(x.cpu(), y.cpu()))
    # Each C++ kernel is called once, queued on the execution engine (compile/kernels.py).
    kernel_calls = [l for l in code.splitlines() if l.strip().startswith("else: _nrt_call(cpp_fused_")]
    assert len(kernel_calls) == 1, code
    assert "device='neuron:0'" in code


def test_matmul_is_an_extern_call_and_reduction_is_fused():
    def f(x, w):
        return (x @ w).relu().sum(dim=1)

    x, w = torch.randn(32, 16, device=DEV), torch.randn(16, 24, device=DEV)
    out, (code,) = run_and_get_code(torch.compile(f, backend="neuron"), x, w)
    torch.testing.assert_close(out.cpu(), f(x.cpu(), w.cpu()), atol=1e-4, rtol=1e-4)
    assert "extern_kernels.mm" in code
    assert "cpp_fused_relu_sum" in code


def test_metrics_count_compile_time_and_reset(metrics):
    f = torch.compile(lambda x: x.tanh() * 3, backend="neuron")
    f(torch.randn(8, device=DEV))
    m = metrics()
    assert m["compilations"] == 1 and m["graphs_lowered"] == 1 and m["compile_time_s"] > 0
    torch.neuron.reset_dynamo_metrics()
    assert all(v == 0 for v in torch.neuron.get_dynamo_metrics().values())


def test_plain_import_torch_installs_flex_attention_hook():
    # The hook itself is exercised in a fresh process by test_inductor_patches.py.
    r = run_python("import torch, torchneuron.compile._hooks as h\nprint(h._installed)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True"
