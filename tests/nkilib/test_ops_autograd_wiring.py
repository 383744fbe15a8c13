"""The autograd wiring of torchneuron/nkilib/ops.py, function by function: what each
``setup_context`` saves, which backward op each ``backward`` calls with which arguments (the
NKI backward kernel, never a PyTorch re-derivation), and which gradients it returns. The
backward ops are replaced by recorders, so no kernel runs here; the numerics of the same paths
against CPU autograd are in test_nkilib_norm_mlp_backward.py, test_nkilib_moe_backward.py,
test_nkilib_attention.py, test_nkilib_grouped_mm.py and test_nkilib_kernels.py.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from torchneuron.nkilib import ops


class Ctx(SimpleNamespace):
    """A stand-in for autograd's ctx: records save_for_backward."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.fixture
def calls(monkeypatch):
    """Replace the named ops of ``ops`` by recorders returning ``("name", args)`` tuples."""
    class Log(list):
        pass

    log = Log()

    def patch(name, result):
        def recorder(*args):
            log.append((name, args))
            return result(*args) if callable(result) else result
        monkeypatch.setattr(ops, name, recorder)

    log.patch = patch
    return log


def _same(a, b):
    return all(x is y for x, y in zip(a, b, strict=True))


# --- attention -----------------------------------------------------------------------------------
def test_attention_saves_inputs_outputs_and_the_scalar_arguments():
    q, k, v, o, lse = (_t(2) for _ in range(5))
    ctx = Ctx()
    ops._attn_setup(ctx, (q, k, v, 0.5, False, 64), (o, lse))
    assert _same(ctx.saved_tensors, (q, k, v, o, lse))
    assert ctx.args == (0.5, False, 64)


def test_attention_backward_calls_the_backward_kernel_op(calls):
    q, k, v, o, lse, do = (_t(2) for _ in range(6))
    grads = (_t(2), _t(2), _t(2))
    calls.patch("attention_bwd", grads)
    ctx = Ctx(saved_tensors=(q, k, v, o, lse), args=(0.5, True, None))
    out = ops._attn_backward(ctx, do, None)
    [(name, args)] = calls
    assert name == "attention_bwd" and _same(args[:6], (q, k, v, o, do, lse)) and args[6:] == (0.5, True, None)
    assert _same(out[:3], grads) and out[3:] == (None, None, None)


def test_attention_scale_defaults_to_one_over_sqrt_head_dim(calls):
    calls.patch("attention_fwd", lambda *a: ("out", "lse"))
    q = _t(1, 1, 4, 16)
    assert ops.attention(q, q, q) == "out"
    [(_, args)] = calls
    assert args[3:] == (1.0 / math.sqrt(16), True, None) and isinstance(args[3], float)


def test_attention_passes_scale_causal_and_window(calls):
    calls.patch("attention_fwd", lambda *a: ("out", "lse"))
    q = _t(1, 1, 4, 16)
    ops.attention(q, q, q, scale=2, causal=0, sliding_window=8)
    [(_, args)] = calls
    assert args[3:] == (2.0, False, 8) and type(args[3]) is float and type(args[4]) is bool


# --- rmsnorm, rope, mlp --------------------------------------------------------------------------
def test_lnc_accepts_one_and_two():
    assert (ops._lnc(1), ops._lnc(2), ops._lnc(2.0)) == (1, 2, 2)


@pytest.mark.parametrize("bad", [0, 3, -1])
def test_lnc_rejects_other_degrees_naming_them(bad):
    with pytest.raises(ValueError, match=f"^lnc must be 1 or 2, got {bad}$"):
        ops._lnc(bad)


def test_rmsnorm_saves_x_and_w_and_eps():
    x, w = _t(3, 4), _t(4)
    ctx = Ctx()
    ops._rmsnorm_setup(ctx, (x, w, 1e-6), _t(3, 4))
    assert _same(ctx.saved_tensors, (x, w)) and ctx.eps == 1e-6


def test_rmsnorm_backward_calls_the_backward_kernel_op_on_one_core(calls):
    x, w, dy = _t(3, 4), _t(4), _t(3, 4)
    dx, dw = _t(3, 4), _t(4)
    calls.patch("rmsnorm_bwd", (dx, dw))
    out = ops._rmsnorm_backward(Ctx(saved_tensors=(x, w), eps=1e-6), dy)
    [(name, args)] = calls
    assert name == "rmsnorm_bwd" and _same(args[:3], (x, w, dy)) and args[3:] == (1e-6, 1)
    assert _same(out[:2], (dx, dw)) and out[2] is None


def test_rope_saves_cos_and_sin():
    x, cos, sin = _t(1, 2, 1, 4), _t(2, 2), _t(2, 2)
    ctx = Ctx()
    ops._rope_setup(ctx, (x, cos, sin), _t(1, 2, 1, 4))
    assert _same(ctx.saved_tensors, (cos, sin))


def test_rope_backward_is_rope_with_the_negated_sine(calls):
    cos, sin, dy = _t(2, 2), _t(2, 2), _t(1, 2, 1, 4)
    dx = _t(1, 2, 1, 4)
    calls.patch("rope", dx)
    out = ops._rope_backward(Ctx(saved_tensors=(cos, sin)), dy)
    [(name, (a_dy, a_cos, a_sin))] = calls
    assert name == "rope" and a_dy is dy and a_cos is cos
    torch.testing.assert_close(a_sin, -sin, rtol=0, atol=0)
    assert out[0] is dx and out[1:] == (None, None)


def test_mlp_saves_every_input():
    inputs = (_t(3, 4), _t(4, 6), _t(4, 6), _t(6, 4))
    ctx = Ctx()
    ops._mlp_setup(ctx, inputs, _t(3, 4))
    assert _same(ctx.saved_tensors, inputs)


def test_mlp_backward_calls_the_backward_kernel_op_on_one_core(calls):
    saved = (_t(3, 4), _t(4, 6), _t(4, 6), _t(6, 4))
    dy = _t(3, 4)
    grads = tuple(_t(*s.shape) for s in saved)
    calls.patch("mlp_bwd", grads)
    out = ops._mlp_backward(Ctx(saved_tensors=saved), dy)
    [(name, args)] = calls
    assert name == "mlp_bwd" and _same(args[:5], saved + (dy,)) and args[5] == 1
    assert _same(out, grads)


# --- cross entropy -------------------------------------------------------------------------------
def test_cross_entropy_saves_logits_labels_and_the_lse_output():
    logits, labels, loss, lse = _t(3, 5), torch.tensor([0, 1, 2]), _t(3), _t(3)
    ctx = Ctx()
    ops._ce_setup(ctx, (logits, labels, -100), (loss, lse))
    assert _same(ctx.saved_tensors, (logits, labels, lse)) and ctx.ignore_index == -100


def test_cross_entropy_backward_calls_the_backward_kernel_op(calls):
    logits, labels, lse, dloss = _t(3, 5), torch.tensor([0, 1, 2]), _t(3), _t(3)
    dlogits = _t(3, 5)
    calls.patch("cross_entropy_bwd", dlogits)
    out = ops._ce_backward(Ctx(saved_tensors=(logits, labels, lse), ignore_index=7), dloss, None)
    [(name, args)] = calls
    assert name == "cross_entropy_bwd" and _same(args[:4], (logits, labels, lse, dloss)) and args[4] == 7
    assert out[0] is dlogits and out[1:] == (None, None)


LOSS = torch.tensor([1.0, 2.0, 0.0, 4.0])
LABELS = torch.tensor([3, 1, -100, 0])


@pytest.fixture
def ce_loss(calls):
    calls.patch("cross_entropy_fwd", lambda logits, labels, ignore: (LOSS, None))
    return calls


def test_cross_entropy_reduction_none_is_the_per_row_loss(ce_loss):
    assert ops.cross_entropy(_t(4, 5), LABELS, reduction="none") is LOSS
    assert ce_loss[0][1][2] == -100


def test_cross_entropy_reduction_sum(ce_loss):
    assert ops.cross_entropy(_t(4, 5), LABELS, reduction="sum").item() == 7.0


def test_cross_entropy_mean_is_over_the_rows_not_ignored(ce_loss):
    assert ops.cross_entropy(_t(4, 5), LABELS).item() == pytest.approx(7.0 / 3)


def test_cross_entropy_mean_uses_the_given_ignore_index(ce_loss):
    assert ops.cross_entropy(_t(4, 5), LABELS, ignore_index=0).item() == pytest.approx(7.0 / 3)
    assert ce_loss[0][1][2] == 0


@pytest.mark.parametrize("bad", ["avg", "MEAN", ""])
def test_cross_entropy_rejects_an_unknown_reduction_naming_it(ce_loss, bad):
    with pytest.raises(ValueError, match=f"reduction must be 'none', 'sum' or 'mean', got {bad!r}"):
        ops.cross_entropy(_t(4, 5), LABELS, reduction=bad)
    assert ce_loss == []  # rejected before any kernel runs


def test_cross_entropy_mean_of_only_ignored_rows_divides_by_one(ce_loss):
    labels = torch.full((4,), -100)
    assert ops.cross_entropy(_t(4, 5), labels).item() == 7.0


# --- MoE -----------------------------------------------------------------------------------------
def test_moe_saves_the_six_tensors_and_the_block_size():
    inputs = tuple(_t(2) for _ in range(6)) + (128, 1)
    ctx = Ctx()
    ops._moe_setup(ctx, inputs, _t(2))
    assert _same(ctx.saved_tensors, inputs[:6]) and ctx.block_size == 128


def test_moe_backward_calls_the_backward_kernel_op_on_one_core(calls):
    saved = tuple(_t(2) for _ in range(6))
    dout = _t(2)
    grads = tuple(_t(2) for _ in range(4))
    calls.patch("moe_cte_bwd", grads)
    out = ops._moe_backward(Ctx(saved_tensors=saved, block_size=128), dout)
    [(name, args)] = calls
    assert name == "moe_cte_bwd" and _same(args[:7], saved + (dout,)) and args[7:] == (128, 1)
    assert _same(out[:4], grads) and out[4:] == (None,) * 4


# --- grouped matmul ------------------------------------------------------------------------------
def test_grouped_mm_saves_every_input():
    inputs = (_t(4, 3), _t(2, 3, 5), torch.tensor([2, 4], dtype=torch.int32))
    ctx = Ctx()
    ops._gmm_setup(ctx, inputs, _t(4, 5))
    assert _same(ctx.saved_tensors, inputs)


def _gmm_ctx(needs):
    a, b = _t(4, 3, dtype=torch.bfloat16), _t(2, 3, 5, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    return Ctx(saved_tensors=(a, b, offs), needs_input_grad=needs), a, b, offs


def test_grouped_mm_backward_gives_da_and_db_through_the_kernels(calls):
    calls.patch("grouped_mm_2d3d", "da")
    calls.patch("grouped_mm_wgrad", "db")
    ctx, a, b, offs = _gmm_ctx((True, True, False))
    dout = _t(4, 5)  # fp32: cast to the inputs' dtype first
    assert ops._gmm_backward(ctx, dout) == ("da", "db", None)
    (n1, (d1, bt, o1)), (n2, (a2, d2, o2)) = calls
    assert (n1, n2) == ("grouped_mm_2d3d", "grouped_mm_wgrad")
    assert d1.dtype == torch.bfloat16 and torch.equal(d1, dout.to(torch.bfloat16)) and d2 is d1
    assert torch.equal(bt, b.transpose(1, 2)) and a2 is a and o1 is offs and o2 is offs


@pytest.mark.parametrize("needs,expected", [((True, False, False), ("da", None, None)),
                                            ((False, True, False), (None, "db", None))])
def test_grouped_mm_backward_skips_gradients_not_needed(calls, needs, expected):
    calls.patch("grouped_mm_2d3d", "da")
    calls.patch("grouped_mm_wgrad", "db")
    assert ops._gmm_backward(_gmm_ctx(needs)[0], _t(4, 5)) == expected
    assert len(calls) == 1


def _wgrad_ctx(needs):
    x, y = _t(4, 3, dtype=torch.bfloat16), _t(4, 5, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    return Ctx(saved_tensors=(x, y, offs), needs_input_grad=needs), x, y, offs


def test_wgrad_backward_gives_dx_and_dy_through_the_grouped_kernel(calls):
    calls.patch("grouped_mm_2d3d", lambda p, q, o: ("d", p, q, o))
    ctx, x, y, offs = _wgrad_ctx((True, True, False))
    dout = _t(2, 3, 5)
    dx, dy, none = ops._wgrad_backward(ctx, dout)
    assert none is None
    assert dx[1] is y and torch.equal(dx[2], dout.to(torch.bfloat16).transpose(1, 2)) and dx[3] is offs
    assert dy[1] is x and torch.equal(dy[2], dout.to(torch.bfloat16)) and dy[2].dtype == torch.bfloat16
    assert dy[3] is offs


@pytest.mark.parametrize("needs,present", [((True, False, False), (True, False)),
                                           ((False, True, False), (False, True))])
def test_wgrad_backward_skips_gradients_not_needed(calls, needs, present):
    calls.patch("grouped_mm_2d3d", "g")
    out = ops._wgrad_backward(_wgrad_ctx(needs)[0], _t(2, 3, 5))
    assert tuple(o is not None for o in out[:2]) == present and out[2] is None
