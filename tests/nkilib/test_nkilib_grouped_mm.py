"""grouped_mm / grouped_mm_wgrad kernels against torch._grouped_mm on the CPU, the torch op
(every torch._grouped_mm layout, autograd) and the routing of torch._grouped_mm on neuron."""

import pytest
import torch

import nki
from torchneuron.nkilib import grouped_mm, grouped_mm_ref, grouped_mm_wgrad, grouped_mm_wgrad_ref
from support import run_python
from torchneuron.nki import NKIArgumentError

OFFS = [40, 40, 170, 300]  # an empty group, groups starting mid-tile, 20 rows past the end


def _data(dtype, T=320, K=200, N=136, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(T, K, generator=g).to(dtype)
    b = (torch.randn(G, K, N, generator=g) / K ** .5).to(dtype)
    return a, b, torch.tensor(OFFS, dtype=torch.int32)


def _rel(x, y):
    return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()


def test_kernel_bf16_matches_torch_grouped_mm_on_cpu():
    a, b, offs = _data(torch.bfloat16)
    out = nki.simulate(grouped_mm)(a, b, tuple(OFFS))
    ref = torch._grouped_mm(a, b, offs=offs)
    assert out.dtype == torch.bfloat16 and out.shape == (320, 136)
    assert _rel(out[:300], ref[:300]) < 1e-2


def test_kernel_rows_past_the_last_group_are_zero():
    a, b, _ = _data(torch.float32)
    out = nki.simulate(grouped_mm)(a, b, tuple(OFFS))
    assert torch.count_nonzero(out[300:]) == 0


def test_kernel_fp32_matches_reference():
    a, b, _ = _data(torch.float32, K=300, N=600)
    assert _rel(nki.simulate(grouped_mm)(a, b, tuple(OFFS)), grouped_mm_ref(a, b, OFFS)) < 1e-5


def test_wgrad_kernel_matches_reference_with_empty_group():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(320, 150, generator=g), torch.randn(320, 520, generator=g)
    out = nki.simulate(grouped_mm_wgrad)(x, y, tuple(OFFS))
    assert out.shape == (4, 150, 520) and torch.count_nonzero(out[1]) == 0
    assert _rel(out, grouped_mm_wgrad_ref(x, y, OFFS)) < 1e-5


def test_kernel_rejects_decreasing_group_ends():
    a, b, _ = _data(torch.float32)
    with pytest.raises(NKIArgumentError, match="non-decreasing"):
        nki.simulate(grouped_mm)(a, b, (40, 30, 170, 300))


@pytest.mark.parametrize("layout", ["2d3d", "3d3d", "3d2d", "2d2d"])
def test_op_matches_torch_grouped_mm_for_every_layout(layout):
    from torchneuron.nkilib.ops import grouped_mm as op
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    offs = torch.tensor([8, 8, 24], dtype=torch.int32)
    a, b, o = {"2d3d": (r(24, 16), r(3, 16, 12), offs), "3d3d": (r(3, 8, 16), r(3, 16, 12), None),
               "3d2d": (r(3, 8, 16), r(16, 24), offs), "2d2d": (r(8, 24), r(24, 12), offs)}[layout]
    assert _rel(op(a, b, o), torch._grouped_mm(a, b, offs=o)) < 1e-5


def test_op_gradients_match_autograd_of_the_reference():
    from torchneuron.nkilib.ops import grouped_mm as op
    a, b, offs = _data(torch.float32, T=200, K=64, N=48)
    offs = torch.tensor([40, 40, 170, 200], dtype=torch.int32)
    dy = torch.randn(200, 48, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (lambda a, b: op(a, b, offs), lambda a, b: grouped_mm_ref(a, b, offs.tolist())):
        a1, b1 = a.clone().requires_grad_(), b.clone().requires_grad_()
        (fn(a1, b1) * dy).sum().backward()
        grads.append((a1.grad, b1.grad))
    assert _rel(grads[0][0], grads[1][0]) < 1e-5 and _rel(grads[0][1], grads[1][1]) < 1e-5


def test_op_rejects_bias_naming_it():
    from torchneuron.nkilib.ops import grouped_mm as op
    a, b, offs = _data(torch.float32)
    with pytest.raises(NotImplementedError, match="bias"):
        op(a, b, offs, bias=torch.zeros(4, 136))


def test_op_rejects_mismatched_contraction_dims():
    from torchneuron.nkilib.ops import grouped_mm as op
    a, b, offs = _data(torch.float32)
    with pytest.raises(ValueError, match=r"a \(T, K\), b \(G, K, N\)"):
        op(a[:, :100], b, offs)


_ROUTED = """
import torch, torchneuron
from torchneuron.nkilib import gmm_routing
{enable}
a = torch.randn(40, 32, dtype=torch.bfloat16); b = torch.randn(3, 32, 24, dtype=torch.bfloat16)
offs = torch.tensor([10, 10, 33], dtype=torch.int32)
ref = torch._grouped_mm(a, b, offs=offs)
an, bn = a.to("neuron").requires_grad_(), b.to("neuron").requires_grad_()
out = torch._grouped_mm(an, bn, offs=offs.to("neuron"))
out.float().sum().backward()
assert out.device.type == "neuron" and bn.grad.shape == b.shape
assert (out.cpu()[:33].float() - ref[:33].float()).abs().max() < 1e-2
print(gmm_routing.calls()["nki"])
"""


def test_enable_routes_neuron_grouped_mm_through_the_kernel():
    p = run_python(_ROUTED.format(enable="gmm_routing.enable()"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "1"


def test_env_var_routes_neuron_grouped_mm_through_the_kernel():
    p = run_python(_ROUTED.format(enable=""), env={"TORCHNEURON_NKI_GROUPED_MM": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "1"


_COMPILED = """
import torch, torchneuron
from torchneuron.nkilib import gmm_routing
gmm_routing.enable()
torch.manual_seed(0)
a = torch.randn(40, 32, dtype=torch.bfloat16); b = torch.randn(3, 32, 24, dtype=torch.bfloat16)
offs = torch.tensor([10, 10, 33], dtype=torch.int32)
ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
ref = torch._grouped_mm(ar, br, offs=offs)
ref[:33].float().sum().backward()
an, bn = a.to("neuron").requires_grad_(), b.to("neuron").requires_grad_()
f = torch.compile(lambda x, y, o: torch._grouped_mm(x, y, offs=o), backend="neuron", fullgraph=True)
out = f(an, bn, offs.to("neuron"))
out[:33].float().sum().backward()
assert (out.cpu()[:33].float() - ref[:33].float()).abs().max() < 1e-2
rel = lambda x, y: ((x.cpu().float() - y.float()).abs().max() / y.float().abs().max()).item()
# rows past offs[-1] belong to no group: torch leaves their gradient undefined
assert rel(an.grad[:33], ar.grad[:33]) < 2e-2 and rel(bn.grad, br.grad) < 2e-2
print(gmm_routing.calls()["nki"])
"""


def test_compiled_grouped_mm_routes_through_the_kernel_with_gradients():
    p = run_python(_COMPILED, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.split()[-1]) >= 1
