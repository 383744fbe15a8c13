"""Behaviour of the small torchneuron.nki changes NKI-lib relies on."""

import torch

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nkilib import rmsnorm


@nki.jit
def _add_one_in_place(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(t, t, nl.add, 1.0)
    nisa.dma_copy(dst=x, src=t)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_read_only_neuron_input_keeps_its_version_counter():
    x = torch.randn(4, 8, device="neuron")
    w = torch.randn(8, device="neuron")
    before = (x._version, w._version)
    rmsnorm(x, w)
    assert (x._version, w._version) == before


def test_kernel_writing_its_neuron_input_is_copied_back():
    x = torch.zeros(4, 8, device="neuron")
    _add_one_in_place(x)
    assert torch.equal(x.cpu(), torch.ones(4, 8))


def test_kernel_errors_point_at_nkilib_kernel_source():
    import pytest

    from torchneuron.nki import NKIShapeError
    with pytest.raises(NKIShapeError) as e:
        nki.simulate(rmsnorm)(torch.zeros(2, 20000), torch.zeros(20000))
    assert "torchneuron/nkilib/" in str(e.value)


def test_package_names_are_kernels_even_after_submodule_imports():
    import torchneuron.nkilib as pkg
    from torchneuron.nkilib import ops  # noqa: F401  (imports every kernel module)
    for name in ("rope", "mlp", "cumsum", "attention_bwd", "attention_cte", "moe_cte"):
        assert isinstance(getattr(pkg, name), nki.Kernel), name


def test_top_level_nkilib_is_the_bundled_aws_layout_package():
    import nkilib

    import torchneuron.nkilib
    assert nkilib is not torchneuron.nkilib
    from nkilib.core.attention.attention_cte import attention_cte
    assert isinstance(attention_cte, nki.Kernel)
