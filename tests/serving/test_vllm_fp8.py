"""FP8 quantized serving on neuron (torchneuron/vllm/quantization.py): vLLM's online FP8 W8A8
methods (per-tensor, per-channel, 128x128 blocks) through ``torch._scaled_mm``.

The oracle is TensorE's FP8 matmul, layer by layer: greedy tokens of a bf16 model cannot be
compared with Hugging Face's across 16 tokens (a bf16 rounding difference elsewhere moves an
activation across an FP8 rounding boundary about once in 16 elements, and the tiny random
model's margins do not absorb the difference), so each quantized layer's output inside the
engine is checked against the exact-product, fp32-sum formula on the layer's own operands,
and its weights against the checkpoint's quantization. ``scaled_fp8_quant`` is checked against
the formulas of vLLM's CUDA kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from serving_support import result_of  # noqa: E402

SCHEMES = {"fp8_tensor": "fp8_per_tensor", "fp8_channel": "fp8_per_channel", "fp8_block": "fp8_per_block"}
LAYERS = {f"model.layers.{i}.{leaf}" for i in range(2)
          for leaf in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
FP8_MAX = 448.0


CHECKPOINT = "fp8_checkpoint"  # a serialized block-FP8 checkpoint (vLLM's "fp8" method)


@pytest.mark.parametrize("key", sorted(SCHEMES) + [CHECKPOINT])
def test_every_projection_is_quantized_and_none_else(quant_engines, key):
    assert set(result_of(quant_engines, key)["fp8_layers"]) == LAYERS


@pytest.mark.parametrize("key", sorted(SCHEMES) + [CHECKPOINT])
def test_quantized_layers_compute_tensore_fp8_matmuls_of_their_operands(quant_engines, key):
    for name, layer in result_of(quant_engines, key)["fp8_layers"].items():
        assert layer["out_dtype"] == "torch.bfloat16"
        # exact products summed in fp32 (in another order), both scales, one rounding: the same
        # bf16 value or its neighbour
        assert layer["max_ulps"] <= 1, (name, layer)


@pytest.mark.parametrize("key", sorted(SCHEMES) + [CHECKPOINT])
def test_weights_are_the_checkpoints_quantized_with_vllms_scales(quant_engines, key):
    # (a serialized checkpoint's stored codes and block scales, fused as vLLM fuses the layers)
    for name, layer in result_of(quant_engines, key)["fp8_layers"].items():
        assert layer["codes_equal"] and layer["scales_equal"], (name, layer)


@pytest.mark.parametrize("key", ["fp8_tensor", "fp8_channel", "fp8_block", CHECKPOINT, "fp8_graphs", "fp8_compiled"])
def test_fp8_engines_generate_through_scaled_mm(quant_engines, key):
    r = result_of(quant_engines, key)
    assert [len(t) for t in r["greedy"]] == [16, 16, 16]
    assert r["scaled_mm_calls"] > 0


def test_fp8_engines_differ_from_the_unquantized_model(engines, quant_engines):
    # (the quantization is in the path: the model without it gives other tokens)
    plain = result_of(engines, "llama")["greedy"]
    assert result_of(quant_engines, "fp8_channel")["greedy"] != plain


def test_fp8_decode_graphs_replay_the_compiled_models_tokens(quant_engines):
    graphs, compiled = result_of(quant_engines, "fp8_graphs"), result_of(quant_engines, "fp8_compiled")
    assert graphs["cudagraph_mode"] == "FULL_DECODE_ONLY" and compiled["cudagraph_mode"] == "NONE"
    assert graphs["graph_replays"] > 0 and compiled["graph_replays"] == 0
    assert graphs["greedy"] == compiled["greedy"]


# ---- scaled_fp8_quant on neuron tensors -----------------------------------------------------

def _quant():
    from torchneuron.vllm.quantization import scaled_fp8_quant

    return scaled_fp8_quant


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _input(rows=5, cols=64, dtype=torch.bfloat16):
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 3).to(dtype)


def test_static_per_tensor_quant_multiplies_by_the_scales_reciprocal():
    x, s = _input(), torch.tensor([0.02])
    q, scale = _quant()(x.to("neuron"), s.to("neuron"))
    assert q.device.type == "neuron" and q.dtype == torch.float8_e4m3fn
    assert torch.equal(_codes(q), _fp8(x.float() * s.reciprocal()))
    assert torch.equal(scale.cpu(), s)


def test_static_per_channel_quant_takes_the_group_shape():
    x, s = _input(), torch.rand(64) * 0.05 + 0.01
    q, _ = _quant()(x.to("neuron"), s.to("neuron"), group_shape=(-1, 1))
    assert torch.equal(_codes(q), _fp8(x.float() * s.reciprocal()))


def test_static_group_quant_broadcasts_each_scale_over_its_group():
    x, s = _input(4, 256), torch.rand(4, 2) * 0.05 + 0.01  # (1, 128) groups
    q, _ = _quant()(x.to("neuron"), s.to("neuron"))
    full = s.repeat_interleave(128, dim=1)
    assert torch.equal(_codes(q), _fp8(x.float() * full.reciprocal()))


def test_dynamic_per_tensor_scale_is_the_amax_over_fp8_max():
    x = _input()
    q, scale = _quant()(x.to("neuron"))
    expected = x.float().abs().max() / FP8_MAX
    assert scale.shape == (1,) and torch.equal(scale.cpu(), expected.reshape(1))
    assert torch.equal(_codes(q), _fp8(x.float() * expected.reciprocal()))


def test_dynamic_per_token_quant_divides_by_each_rows_scale_bounded_by_scale_ub():
    x = _input()
    ub = torch.tensor([x.float().abs().amax(dim=1).median().item()])
    q, scale = _quant()(x.to("neuron"), scale_ub=ub.to("neuron"), use_per_token_if_dynamic=True)
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(max=ub)
    expected = (amax / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512))
    assert scale.shape == (5, 1) and torch.equal(scale.cpu(), expected)
    assert torch.equal(_codes(q), _fp8(x.float() / expected))


def test_an_all_zero_input_quantizes_to_zeros_not_nan():
    q, scale = _quant()(torch.zeros(3, 32, device="neuron"))
    assert scale.item() > 0 and not torch.isnan(q.cpu().float()).any()
    assert torch.equal(_codes(q), torch.zeros(3, 32, dtype=torch.uint8))


def test_padding_rows_are_zero():
    x = _input(3, 32)
    q, _ = _quant()(x.to("neuron"), torch.tensor([0.01], device="neuron"), num_token_padding=8)
    assert q.shape == (8, 32)
    assert torch.equal(_codes(q)[3:], torch.zeros(5, 32, dtype=torch.uint8))


def test_quant_writes_into_a_given_output():
    x, out = _input(), torch.empty(5, 64, dtype=torch.float8_e4m3fn, device="neuron")
    q, _ = _quant()(x.to("neuron"), torch.tensor([0.02], device="neuron"), output=out)
    assert q is out


def test_quant_rejects_inputs_that_are_not_matrices():
    with pytest.raises(ValueError, match="2-D"):
        _quant()(torch.zeros(2, 3, 4, device="neuron"))


def test_registration_routes_only_neuron_tensors(monkeypatch):
    import vllm._custom_ops as ops

    from torchneuron.vllm import quantization

    quantization.register()
    quantization.register()  # idempotent: one wrapper
    assert not hasattr(ops.scaled_fp8_quant.__wrapped__, "__wrapped__")
    seen = []
    monkeypatch.setattr(ops.scaled_fp8_quant, "__wrapped__", lambda t, *a, **k: seen.append(t.device.type))
    x, s = _input(), torch.tensor([0.02])
    q, _ = ops.scaled_fp8_quant(x.to("neuron"), s.to("neuron"))
    assert torch.equal(_codes(q), _fp8(x.float() * s.reciprocal())) and seen == []
    ops.scaled_fp8_quant(x, s)  # CPU: vLLM's own function
    assert seen == ["cpu"]
