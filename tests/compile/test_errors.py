"""Failure behaviour: a clear error naming op and location, or eager fallback."""

import pytest
import torch
from torch._inductor.lowering import register_lowering

from compile_models import DEV
from torchneuron.compile import backend as nb

_lib = torch.library.Library("tn_compile_test", "DEF")
_lib.define("unlowerable(Tensor x) -> Tensor")
_lib.impl("unlowerable", lambda x: x * 2 + 1, "CompositeExplicitAutograd")
torch.library.register_fake("tn_compile_test::unlowerable", lambda x: torch.empty_like(x), lib=_lib)


@register_lowering(torch.ops.tn_compile_test.unlowerable.default)
def _refuse(x):
    # Stands in for an op the neuron code generator cannot handle.
    raise NotImplementedError("no neuron lowering for this op")


def _model(x):
    y = x.relu()
    z = torch.ops.tn_compile_test.unlowerable(y)  # the failing line
    return z.sum()


def test_compile_error_names_op_and_source_location(monkeypatch):
    monkeypatch.delenv("TORCHNEURON_COMPILE_FALLBACK", raising=False)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(_model, backend="neuron")(torch.randn(8, device=DEV))
    msg = str(info.value)
    assert "tn_compile_test.unlowerable" in msg
    assert "test_errors.py" in msg and "_model" in msg
    assert "no neuron lowering for this op" in msg
    assert "TORCHNEURON_COMPILE_FALLBACK" in msg


def test_fallback_runs_graph_eagerly_and_warns_once(monkeypatch, metrics):
    monkeypatch.setenv("TORCHNEURON_COMPILE_FALLBACK", "1")
    torch._dynamo.reset()
    nb._warned.clear()
    x = torch.randn(8, device=DEV)
    with pytest.warns(UserWarning, match="tn_compile_test.unlowerable") as record:
        out = torch.compile(_model, backend="neuron")(x)
        torch._dynamo.reset()
        out2 = torch.compile(_model, backend="neuron")(x)  # same failure again: no new warning
    assert sum("unlowerable" in str(w.message) for w in record) == 1
    expected = (x.cpu().relu() * 2 + 1).sum()
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(out2.cpu(), expected)
    assert metrics()["eager_fallbacks"] == 2


def test_cpp_wrapper_and_aotinductor_raise_a_clear_error(monkeypatch, tmp_path):
    """Inductor's C++ wrapper (cpp_wrapper=True, AOTInductor) is not implemented for neuron:
    the error names it and the way out, instead of an assertion inside code generation."""
    monkeypatch.delenv("TORCHNEURON_COMPILE_FALLBACK", raising=False)
    m = torch.nn.Linear(4, 2).to(DEV)
    x = torch.randn(3, 4, device=DEV)
    torch._dynamo.reset()
    with torch._inductor.config.patch(cpp_wrapper=True):
        with pytest.raises(Exception, match="C\\+\\+ wrapper is not implemented for neuron"):
            torch.compile(m, backend="neuron")(x)
    ep = torch.export.export(m, (x,))
    with pytest.raises(Exception, match="C\\+\\+ wrapper is not implemented for neuron"):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
