"""The Inductor/FlexAttention patches change behaviour for neuron only."""

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from torch._inductor import config, ir, utils
from torch._inductor.scheduler import BaseSchedulerNode

from torchneuron.compile import inductor_patches


def test_apply_is_idempotent():
    before = (BaseSchedulerNode.is_cpu, utils.get_current_backend, ir.is_cpu, fa._validate_device)
    inductor_patches.apply()
    inductor_patches.apply()
    assert before == (BaseSchedulerNode.is_cpu, utils.get_current_backend, ir.is_cpu,
                      fa._validate_device)


def test_current_backend_is_cpp_for_neuron_and_unchanged_for_others():
    assert utils.get_current_backend("neuron") == config.cpu_backend == "cpp"
    assert utils.get_current_backend("cpu") == config.cpu_backend
    assert utils.get_current_backend("cuda") == config.cuda_backend
    import torch._inductor.codegen.common as common

    assert common.get_current_backend is utils.get_current_backend


def test_ir_is_cpu_covers_neuron_only():
    assert ir.is_cpu(torch.device("neuron", 0))
    assert ir.is_cpu(torch.device("cpu"))
    assert not ir.is_cpu(torch.device("meta"))


def test_flex_validate_device_allows_neuron_but_still_rejects_unknown_devices():
    q = torch.empty(1, 1, 4, 4, device="neuron", requires_grad=True)
    fa._validate_device(q, q, q)  # no error: neuron supports forward and backward
    m = torch.empty(1, 1, 4, 4, device="meta")
    with pytest.raises(ValueError, match="FlexAttention is only supported"):
        fa._validate_device(m, m, m)
    c = torch.empty(1, 1, 4, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        fa._validate_device(c, c, c)


def test_import_hook_patches_flex_attention_in_a_fresh_process():
    from support import run_python

    r = run_python(
        "import torchneuron.compile as t; t.install_import_hooks()\n"
        "import torch\n"
        "from torch.nn.attention.flex_attention import flex_attention\n"
        "q = torch.randn(1, 2, 8, 4, device='neuron')\n"
        "print(flex_attention(q, q, q).device)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("neuron:0")


def test_sdpa_on_neuron_under_the_python_dispatcher_matches_cpu():
    # Tracing runs SDPA's composite with the Python dispatcher on; neuron's kernel choice must
    # work there (no patch needed) and agree with CPU.
    from torch._dispatch.python import enable_python_dispatcher

    q = torch.randn(1, 2, 8, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with enable_python_dispatcher():
        out = torch.nn.functional.scaled_dot_product_attention(*(q.to("neuron"),) * 3, is_causal=True)
    torch.testing.assert_close(out.cpu(), ref)


# x / c where x * (1 / c) rounds differently (Inductor's rewrite for non-CPU devices)
DIV_VALUES = torch.tensor([0.314453125, 0.31640625, 3.0, 1e-3, -7.5, 0.0]).repeat(6)


def test_a_compiled_division_by_a_constant_is_a_true_division_on_neuron():
    assert not torch.equal(DIV_VALUES / 448.0, DIV_VALUES * (1 / 448.0))  # (the values tell them apart)
    f = torch.compile(lambda t: (t / 448.0, t.abs().amax(0, keepdim=True).clamp(1e-4) / 448.0),
                      backend="neuron", fullgraph=True)
    x = DIV_VALUES.reshape(6, 6)
    got = f(x.to("neuron"))
    assert torch.equal(got[0].cpu(), x / 448.0)
    assert torch.equal(got[1].cpu(), x.abs().amax(0, keepdim=True).clamp(1e-4) / 448.0)


def test_the_division_patch_keeps_integer_division_and_pooling():
    f = torch.compile(lambda t: (t // 3, t.int() / 3, torch.nn.functional.avg_pool1d(t.reshape(1, 6, 6), 3)),
                      backend="neuron", fullgraph=True)
    x = DIV_VALUES.reshape(6, 6)
    floor, idiv, pool = f(x.to("neuron"))
    assert torch.equal(floor.cpu(), x // 3)
    assert torch.equal(idiv.cpu(), x.int() / 3)
    assert torch.equal(pool.cpu(), torch.nn.functional.avg_pool1d(x.reshape(1, 6, 6), 3))


def test_the_division_lowering_is_registered_once_and_wraps_inductors():
    from torch._inductor import lowering

    inductor_patches.apply()
    assert lowering.lowerings[torch.ops.prims.div] is lowering.div_prim
    assert not hasattr(lowering.div_prim._torchneuron_orig, "_torchneuron_orig")
