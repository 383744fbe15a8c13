"""``torch.compile(model)`` with no backend on neuron tensors: PyTorch's default (Inductor) entry
compiles neuron graphs with neuron code generation, with nothing registered by hand.

Each behaviour that depends on what ``import torch`` alone set up runs in a fresh interpreter
(this test session registered the backend explicitly in conftest.py)."""

import warnings

import torch
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from compile_models import DEV, MLP, SmallCNN, assert_close, attention_reference, clone_to
from support import run_python


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def test_plain_torch_compile_after_import_torch_runs_neuron_kernels_and_trains_flex_attention():
    # One fresh interpreter: nothing registered by hand, only what `import torch` set up.
    # FlexAttention training: Inductor's own lowering for C++ devices is inference-only
    # ("torch.compile on CPU only supports inference"); the neuron pipeline decomposes it.
    out = _ok(run_python(
        "import torch\n"
        "from torch._inductor.utils import run_and_get_code\n"
        "from torch.nn.attention.flex_attention import flex_attention, create_block_mask\n"
        "f = torch.compile(lambda x: ((x * 2).sin() + 1).relu())\n"
        "x = torch.randn(64, device='neuron')\n"
        "y, (code,) = run_and_get_code(f, x)\n"
        "torch.testing.assert_close(y.cpu(), ((x.cpu() * 2).sin() + 1).relu())\n"
        "print(y.device, \"device='neuron:0'\" in code, 'cpp_fused_' in code)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cpu = [torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(3)]\n"
        "q, k, v = [t.float().to('neuron').requires_grad_() for t in cpu]\n"
        "bm = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 64, 64, device='neuron')\n"
        "out = torch.compile(flex_attention)(q, k, v, block_mask=bm)\n"
        "out.sum().backward()\n"
        "qc, kc, vc = [t.requires_grad_() for t in cpu]\n"
        "s = (qc @ kc.transpose(-1, -2) / 4.0).masked_fill(\n"
        "    ~torch.ones(64, 64, dtype=torch.bool).tril(), float('-inf'))\n"
        "ref = s.softmax(-1) @ vc\n"
        "ref.sum().backward()\n"
        "torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=1e-5, rtol=1e-4)\n"
        "for a, b in ((q, qc), (k, kc), (v, vc)):\n"
        "    torch.testing.assert_close(a.grad.cpu().double(), b.grad, atol=1e-5, rtol=1e-4)\n"
        "m = torch.neuron.get_dynamo_metrics()\n"
        "print(m['compilations'], m['flex_attention_decomposed'])\n"))
    assert out[-2:] == ["neuron:0 True True", "2 1"]


def test_dynamo_interface_and_plain_inductor_codegen_need_no_registration():
    # Dynamo knows the device interface as soon as it loads; compile_fx as the backend (no
    # neuron pipeline) finds the code generators through its own lookup of torch.neuron.*.
    out = _ok(run_python(
        "import torch\n"
        "from torch._dynamo.device_interface import get_interface_for_device\n"
        "print(get_interface_for_device('neuron').__name__, get_interface_for_device('neuron:1').__name__)\n"
        "from torch._inductor.compile_fx import compile_fx\n"
        "from torch._inductor.codegen.common import device_codegens\n"
        "f = torch.compile(lambda x: x.cos() * 3, backend=compile_fx)\n"
        "x = torch.randn(32, device='neuron')\n"
        "torch.testing.assert_close(f(x).cpu(), x.cpu().cos() * 3)\n"
        "print(device_codegens['neuron'].scheduling.__name__)\n"
        "print(torch.neuron.get_dynamo_metrics()['compilations'])\n"))
    assert out[-3:] == ["NeuronInterface NeuronInterface", "NeuronCppScheduling", "0"]


def test_default_backend_compiles_mlp_training_like_cpu(metrics):
    torch.manual_seed(0)
    ref = MLP()
    model = clone_to(ref, DEV)
    x = torch.randn(8, 16)
    out = torch.compile(model)(x.to(DEV))
    out.square().mean().backward()
    expected = ref(x)
    expected.square().mean().backward()
    assert_close(out, expected)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)
    assert metrics()["compilations"] == 1


def test_default_backend_keeps_conv_layouts_as_the_neuron_backend_does(metrics):
    # Inductor's layout optimisation would turn conv inputs channels_last for a non-CPU device,
    # which the neuron kernels' strides do not follow; the neuron settings switch it off.
    torch.manual_seed(0)
    ref = SmallCNN()
    model = clone_to(ref, DEV)
    x = torch.randn(2, 3, 16, 16)
    out = torch.compile(model)(x.to(DEV))
    out.sum().backward()
    expected = ref(x)
    expected.sum().backward()
    assert_close(out, expected)
    assert metrics()["compilations"] == 1


def test_default_backend_flex_attention_training_in_process_matches_math():
    B, H, L, D = 1, 2, 128, 16
    g = torch.Generator().manual_seed(1)
    cpu = [torch.randn(B, H, L, D, generator=g) for _ in range(3)]
    q, k, v = [t.to(DEV).requires_grad_() for t in cpu]
    bm = create_block_mask(lambda b, h, i, j: i >= j, B, H, L, L, device=DEV)
    out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    grad = torch.randn(B, H, L, D, generator=g)
    out.backward(grad.to(DEV))
    leaves = [t.double().requires_grad_() for t in cpu]
    ref = attention_reference(*leaves, mask=torch.ones(L, L, dtype=torch.bool).tril())
    ref.backward(grad.double())
    assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    for a, b in zip((q, k, v), leaves):
        assert_close(a.grad.double(), b.grad, atol=1e-5, rtol=1e-4)


def test_cpu_graphs_under_the_default_backend_stay_with_inductor(metrics):
    f = torch.compile(lambda x: x.exp() - 1)
    x = torch.randn(16)
    torch.testing.assert_close(f(x), x.exp() - 1)
    assert metrics()["compilations"] == 0


def test_graph_creating_neuron_tensors_without_inputs_is_a_neuron_graph(metrics):
    f = torch.compile(lambda: torch.ones(4, device=DEV) * 3)
    out = f()
    assert out.device == DEV and out.cpu().tolist() == [3.0] * 4
    assert metrics()["compilations"] == 1


def test_reduce_overhead_mode_on_neuron_replays_neuron_graphs(metrics):
    f = torch.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    xs = [torch.randn(8, device=DEV) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "no CUDA graphs" nor a CUDA graph tree error
        out, (code,) = run_and_get_code(f, xs[0])
        outs = [out] + [f(x) for x in xs[1:]]
    for out, x in zip(outs, xs):
        torch.testing.assert_close(out.cpu(), x.cpu() * 2 + 1)
    assert "cpp_fused_" in code
    m = metrics()
    assert m["compilations"] == 1 and m["graphs_recorded"] == 1 and m["graph_replays"] == 2

