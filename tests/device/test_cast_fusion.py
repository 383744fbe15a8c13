"""Adaptive Eager's precompiled family (torch.neuron.engine.set_cast_fusion_enabled, on by
default): queued casts (bfloat16 -> float32 -> fp8), products with a 0-dim tensor and clamps run
as one pass over the elements, bit-identical to the kernels one by one.

Oracles: CPU PyTorch (every case), and the same program with the family off. Inputs carry the
values whose bits a path could change: NaN of either sign and other payloads, infinities,
subnormals, values past fp8's range, signed zeros.
"""

from __future__ import annotations

import pytest
import torch

import torchneuron
from support import run_python

engine = torch.neuron.engine
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def hard_bf16(*shape, seed=0):
    """bfloat16 values of every class: random bit patterns (NaNs with payloads and signs,
    infinities, subnormals), then ordinary and fp8-overflowing magnitudes, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    bits = torch.randint(0, 1 << 16, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).clone()
    x[: n // 2] = torch.randn(n // 2, generator=g).to(torch.bfloat16) * 300
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")], dtype=torch.bfloat16)
    return x.view(*shape)


def scaling_cast(x, scale, fp8):
    """torchao's float8 cast (hp_tensor_and_scale_to_float8): to float32, times the scale,
    clamped to the format's range, to fp8."""
    m = torch.finfo(fp8).max
    return (x.to(torch.float32) * scale).clamp(-m, m).to(fp8)


def as_bits(t):
    """t's bit patterns (on the CPU), to compare NaNs and signed zeros exactly."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return t.cpu().reshape(-1).view(ints[t.element_size()])


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_scaling_cast_runs_as_one_region_with_cpu_bits(cast_fusion_on, fp8, layout):
    x = hard_bf16(384, 200, seed=1)
    if layout == "transposed":
        x = x.t()  # a weight's transpose: dense, not contiguous
    scale = torch.tensor(1.7)
    want = scaling_cast(x, scale, fp8)
    before = engine.stats()
    got = scaling_cast(x.to("neuron"), scale.to("neuron"), fp8)
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 4 and after["tiled"] - before["tiled"] == 1
    assert got.stride() == want.stride()
    assert torch.equal(as_bits(got), as_bits(want))


def test_fused_equals_unfused_bit_for_bit_on_every_float32_pattern(cast_fusion_on):
    # Random float32 bits through each step kept (stored) and chained: NaN payloads pass
    # through the scale and the clamp as on ATen's paths, and narrow as c10 narrows them.
    g = torch.Generator().manual_seed(2)
    f = torch.randint(-(2**31), 2**31 - 1, (70001,), generator=g, dtype=torch.int32).view(torch.float32)

    def program(t, s):
        a = t * s
        b = a.clamp(-300.0, 200.0)
        return a, b, b.to(torch.float8_e4m3fn), a.to(torch.float8_e5m2)

    want = program(f, torch.tensor(-0.75))
    before = engine.stats()["tiled"]
    got = program(f.to("neuron"), torch.tensor(-0.75, device="neuron"))
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    for g_, w in zip(got, want):
        assert torch.equal(as_bits(g_), as_bits(w))
    engine.set_cast_fusion_enabled(False)
    unfused = program(f.to("neuron"), torch.tensor(-0.75, device="neuron"))
    for g_, u in zip(got, unfused):
        assert torch.equal(as_bits(g_), as_bits(u))


def test_tail_of_a_tile_and_of_a_vector_computed_like_the_rest(cast_fusion_on):
    # 1024-element tiles, 16-lane vectors: 40003 elements leave both a partial tile and a
    # scalar tail in each thread's range.
    x = hard_bf16(40003, seed=3)
    want = scaling_cast(x, torch.tensor(0.3), torch.float8_e4m3fn)
    got = scaling_cast(x.to("neuron"), torch.tensor(0.3, device="neuron"), torch.float8_e4m3fn)
    assert torch.equal(as_bits(got), as_bits(want))


def test_nan_bits_pass_scale_and_clamp_in_vectors_and_in_the_tail(cast_fusion_on):
    # 47 elements: two 16-lane vectors and a 15-element scalar tail, every one a NaN of some
    # sign and payload (or an infinity): both paths must keep their bits as ATen's do.
    g = torch.Generator().manual_seed(9)
    payload = torch.randint(1, 1 << 22, (47,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (47,), generator=g, dtype=torch.int32) << 31
    f = (payload | (0xFF << 23) | sign).view(torch.float32)
    f[5], f[40] = float("inf"), float("-inf")

    def program(t, s):
        c = (t * s).clamp(-448.0, 448.0)
        return c, c.to(torch.float8_e4m3fn)

    want = program(f, torch.tensor(2.0))
    got = program(f.to("neuron"), torch.tensor(2.0, device="neuron"))
    for g_, w in zip(got, want):
        assert torch.equal(as_bits(g_), as_bits(w))


def random_float32(n, seed):
    """float32 values of every bit pattern (NaN payloads of both signs, infinities, subnormals)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32)


# A scaling cast whose float32 temporaries die at once, as torchao's do, runs in registers
# (fp8.cpp, scaled_narrow): each form, from bfloat16 (widened) or from float32.
SCALING_FORMS = {
    "widen, scale, clamp": (torch.bfloat16, lambda t, s, m: (t.to(torch.float32) * s).clamp(-m, m)),
    "widen, scale": (torch.bfloat16, lambda t, s, m: t.to(torch.float32) * s),
    "widen, clamp": (torch.bfloat16, lambda t, s, m: t.to(torch.float32).clamp(-m, m)),
    "widen": (torch.bfloat16, lambda t, s, m: t.to(torch.float32)),
    "scale, clamp": (torch.float32, lambda t, s, m: (t * s).clamp(-m, m)),
    "scale": (torch.float32, lambda t, s, m: t * s),
}


@pytest.mark.parametrize("form", SCALING_FORMS)
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_a_cast_whose_temporaries_die_keeps_every_bit(cast_fusion_on, form, fp8):
    # 40003 elements: partial tiles and partial 16-lane vectors (masked lanes) in each range.
    dtype, f = SCALING_FORMS[form]
    x = hard_bf16(40003, seed=21) if dtype == torch.bfloat16 else random_float32(40003, seed=21)
    s, m = torch.tensor(0.37), torch.finfo(fp8).max
    xn, sn = x.to("neuron"), s.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    got = f(xn, sn, m).to(fp8)
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    assert torch.equal(as_bits(got), as_bits(f(x, s, m).to(fp8)))


def test_a_temporary_two_kernels_read_is_computed_for_both(cast_fusion_on):
    # The product feeds the clamp and, later in the region, a second narrowing: a pass in
    # registers from the product to the first fp8 result would leave the second nothing to read.
    x = hard_bf16(40003, seed=22)
    s = torch.tensor(1.9)

    def program(t, sc):
        y = t.to(torch.float32) * sc
        a = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        b = y.to(torch.float8_e5m2)
        return a, b

    xn, sn = x.to("neuron"), s.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()
    got = program(xn, sn)
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 5 and after["tiled"] - before["tiled"] == 1
    for g_, w in zip(got, program(x, s)):
        assert torch.equal(as_bits(g_), as_bits(w))


def test_a_result_still_referenced_is_stored(cast_fusion_on):
    # The intermediates are kept here: the fused pass must write each of them.
    x = hard_bf16(5000, seed=4)
    s = torch.tensor(2.5)
    xn, sn = x.to("neuron"), s.to("neuron")
    w32 = x.to(torch.float32)
    wm = w32 * s
    wc = wm.clamp(-448.0, 448.0)
    g32 = xn.to(torch.float32)
    gm = g32 * sn
    gc = gm.clamp(-448.0, 448.0)
    g8 = gc.to(torch.float8_e4m3fn)
    for got, want in [(g32, w32), (gm, wm), (gc, wc), (g8, wc.to(torch.float8_e4m3fn))]:
        assert torch.equal(as_bits(got), as_bits(want))


def test_an_output_taking_a_dead_intermediates_memory_joins_the_region(cast_fusion_on):
    # torchao's cast frees each float32 temporary at once, so the fp8 result is allocated in
    # the memory of the product (dead by then): the fuser lets it join instead of ending the
    # region there, and never stores the dead product over it.
    x = hard_bf16(2048, 1024, seed=5)
    s = torch.tensor(3.0)
    xn, sn = x.to("neuron"), s.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()
    got = scaling_cast(xn, sn, torch.float8_e4m3fn)
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 4  # all four kernels in one region
    assert torch.equal(as_bits(got), as_bits(scaling_cast(x, s, torch.float8_e4m3fn)))


def test_overlapping_views_of_one_live_allocation_end_the_region(cast_fusion_on):
    # Two casts into overlapping views of one buffer: the second overwrites part of the first.
    # Fused in one pass, tile order would interleave them; the region must end between them.
    a, b = hard_bf16(4096, seed=6), hard_bf16(4096, seed=7)
    want = torch.empty(4096 + 512)
    want[:4096].copy_(a)
    want[512:].copy_(b)
    base = torch.empty(4096 + 512, device="neuron")
    an, bn = a.to("neuron"), b.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["fused"]
    base[:4096].copy_(an)
    base[512:].copy_(bn)
    torch.neuron.synchronize()
    assert engine.stats()["fused"] == before  # two single-kernel regions: nothing fused
    assert torch.equal(as_bits(base), as_bits(want))


def test_a_factor_inside_a_buffer_of_the_region_ends_the_region(cast_fusion_on):
    # The 0-dim factor is an element of a tensor the region writes: read when the fused pass
    # starts, it would be the value before that write.
    x = hard_bf16(4096, seed=8)
    xn = x.to("neuron")
    y = xn.to(torch.float32)
    z = y * y[7]
    want = x.to(torch.float32) * x.to(torch.float32)[7]
    assert torch.equal(as_bits(z), as_bits(want))


def test_a_factor_whose_memory_a_later_product_takes_ends_the_region(cast_fusion_on):
    # A region's groups run one after the other, each first seen first, not in program order:
    # here the product into f's freed memory (8192 values, the group of the first product) would
    # run before the 4096-value product that reads f[7] as its factor, which would then read
    # the new value.
    g = torch.Generator().manual_seed(11)
    y, x, f = (torch.randn(n, generator=g) for n in (8192, 4096, 8192))
    s, s2 = torch.tensor(1.5), torch.tensor(-3.0)
    yn, xn, sn, s2n = y.to("neuron"), x.to("neuron"), s.to("neuron"), s2.to("neuron")
    fn = f.to("neuron")
    torch.neuron.synchronize()
    taken = fn.data_ptr()
    a = yn * sn
    b = xn * fn[7]
    del fn
    c = yn * s2n
    assert c.data_ptr() == taken  # the allocator handed f's block to c
    assert torch.equal(as_bits(b), as_bits(x * f[7]))
    assert torch.equal(as_bits(a), as_bits(y * s))
    assert torch.equal(as_bits(c), as_bits(y * s2))


def test_two_casts_with_one_factor_run_in_one_region(cast_fusion_on):
    # A static scale (or one loss scale for many tensors): two kernels read one factor, which
    # nothing writes, so the region need not end between them.
    x, y = hard_bf16(4096, seed=25), hard_bf16(4096, seed=26)
    s = torch.tensor(0.6)
    xn, yn, sn = x.to("neuron"), y.to("neuron"), s.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()
    got = [scaling_cast(xn, sn, torch.float8_e4m3fn), scaling_cast(yn, sn, torch.float8_e5m2)]
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 8 and after["tiled"] - before["tiled"] == 1
    for g_, w in zip(got, [scaling_cast(x, s, torch.float8_e4m3fn), scaling_cast(y, s, torch.float8_e5m2)]):
        assert torch.equal(as_bits(g_), as_bits(w))


@pytest.mark.parametrize("n", [4096, 5000], ids=["same group", "other group"])
def test_a_factor_a_max_of_the_region_writes_ends_the_region(cast_fusion_on, n):
    # The product reads its factor when its group runs, before the pass after which the max
    # writes it: in one region it would read the value from before the max.
    # (The abs is kept, so that the product's output cannot take its memory: that alone would
    # end the region, kAbs's rules.)
    g = torch.Generator().manual_seed(27)
    x, y = torch.randn(4096, generator=g), torch.randn(n, generator=g)
    xn, yn = x.to("neuron"), y.to("neuron")
    torch.neuron.synchronize()
    a = torch.abs(xn)
    m = torch.max(a)
    z = yn * m
    assert torch.equal(as_bits(z), as_bits(y * torch.max(torch.abs(x))))
    assert torch.equal(as_bits(a), as_bits(torch.abs(x)))


@pytest.mark.parametrize("lo,hi", [(float("nan"), 1.0), (5.0, -5.0)])
def test_clamp_with_a_nan_bound_or_an_empty_range_matches_cpu(cast_fusion_on, lo, hi):
    # A NaN bound is left to ATen's kernel (no record); an empty range (lo > hi) fuses and
    # gives hi, as ATen's max-then-min does.
    f = torch.randn(4096) * 10
    s = torch.tensor(1.5)
    want = (f * s).clamp(lo, hi)
    got = (f.to("neuron") * s.to("neuron")).clamp(lo, hi)
    assert torch.equal(as_bits(got), as_bits(want))


def test_clamp_bounds_past_float32_raise_cpu_error_and_lose_nothing(cast_fusion_on):
    # CPU raises converting the bound; the fuser leaves such a clamp to ATen's kernel, whose
    # error surfaces, and the product before it is still computed.
    f = torch.randn(4096) * 10
    fn, sn = f.to("neuron"), torch.tensor(1.5, device="neuron")
    with pytest.raises(RuntimeError, match="overflow"):
        (f * 1.5).clamp(-1e300, 1e300)
    with pytest.raises(RuntimeError, match="overflow"):
        m = fn * sn
        m.clamp(-1e300, 1e300)
        torch.neuron.synchronize()
    assert torch.equal(as_bits(m), as_bits(f * torch.tensor(1.5)))


def test_deterministic_algorithms_turn_cast_fusion_off(cast_fusion_on):
    x = torch.randn(4096, dtype=torch.bfloat16, device="neuron")
    s = torch.tensor(2.0, device="neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    torch.use_deterministic_algorithms(True)
    try:
        scaling_cast(x, s, torch.float8_e4m3fn)
        torch.neuron.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    assert engine.stats()["tiled"] == before


def test_a_fused_cast_region_failing_reports_at_the_next_synchronization(cast_fusion_on):
    x = torch.randn(4096, dtype=torch.bfloat16, device="neuron")
    s = torch.tensor(2.0, device="neuron")
    torch.neuron.synchronize()
    torchneuron._C._fusion_fail_after(0)
    scaling_cast(x, s, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="fused region of 4 kernels.*injected fault"):
        torch.neuron.synchronize()
    got = scaling_cast(x, s, torch.float8_e4m3fn)  # the device stays usable
    assert torch.equal(as_bits(got), as_bits(scaling_cast(x.cpu(), s.cpu(), torch.float8_e4m3fn)))


CONFIGURED = "import torch; e = torch.neuron.engine; print(e.is_cast_fusion_enabled(), e.is_fusion_enabled())"


@pytest.mark.parametrize("value,casts,generated", [("", True, False), ("1", True, True), ("0", False, False)])
def test_cast_fusion_configured_by_environment(value, casts, generated):
    r = run_python(CONFIGURED, env={"TORCH_NEURONX_ENABLE_CONCATENATION": value})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(casts), str(generated)]


def test_torchao_float8_training_step_equals_unfused(cast_fusion_on):
    # torchao's float8 linear: 12 scaling casts a step, each a region; the gradients equal
    # the step with the family off, bit for bit.
    pytest.importorskip("torchao")
    from torchao.float8 import convert_to_float8_training

    def grads():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.GELU(),
                                    torch.nn.Linear(128, 64, bias=False)).to("neuron", torch.bfloat16)
        convert_to_float8_training(model)
        x = torch.randn(32, 64, device="neuron", dtype=torch.bfloat16, requires_grad=True)
        model(x).float().square().sum().backward()
        return [p.grad.cpu() for p in model.parameters()] + [x.grad.cpu()]

    before = engine.stats()["tiled"]
    fused = grads()
    assert engine.stats()["tiled"] - before >= 6
    engine.set_cast_fusion_enabled(False)
    for f, u in zip(fused, grads()):
        assert torch.equal(f.view(torch.int16), u.view(torch.int16))


# ---- amax: max(abs(x)), the scale's reduction -----------------------------------------------


def nan_bf16(n, seed):
    """bfloat16 NaNs of both signs and many payloads (ATen's scalar abs canonicalizes them,
    its vector abs keeps them) among ordinary values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(torch.bfloat16)
    payload = torch.randint(1, 0x80, (n // 7,), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (n // 7,), generator=g, dtype=torch.int32) << 15
    x.view(torch.int16)[::7][: n // 7] = (payload | 0x7F80 | sign).to(torch.int16)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_amax_runs_as_one_region_with_cpu_bits(cast_fusion_on, dtype, layout):
    x = (torch.randn(640, 300) * 50).to(dtype)
    if layout == "transposed":
        x = x.t()
    xn = x.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()
    got = torch.max(torch.abs(xn))
    torch.neuron.synchronize()
    after = engine.stats()
    assert after["fused"] - before["fused"] == 2 and after["tiled"] - before["tiled"] == 1
    assert torch.equal(as_bits(got), as_bits(torch.max(torch.abs(x))))


def assert_amax_in_one_region_with_cpu_bits(x):
    """torchao's amax, torch.max(torch.abs(x)), runs on neuron as one fused group with CPU's bits."""
    xn = x.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    got = torch.max(torch.abs(xn))
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    assert torch.equal(as_bits(got), as_bits(torch.max(torch.abs(x))))


def test_amax_of_nans_takes_atens_bits(cast_fusion_on):
    # The order-free max holds except for which NaN: that result comes from ATen's kernels
    # over the same memory (the redo).
    x = nan_bf16(40003, seed=10)
    assert_amax_in_one_region_with_cpu_bits(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", [45, 40003])
def test_amax_whose_largest_magnitude_is_the_last_element(cast_fusion_on, dtype, n):
    # The last element falls past the last full vector of its range (64 bf16 or 16 fp32
    # lanes): the scalar tail must see it. Negative, as the sign must not count.
    x = (torch.rand(n, generator=torch.Generator().manual_seed(23)) * 10).to(dtype)
    x[-1] = -1000.0
    assert_amax_in_one_region_with_cpu_bits(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("where", [0, 20001, 40002])
def test_amax_with_one_signaling_nan_is_nan(cast_fusion_on, dtype, where):
    # A NaN with the quiet bit clear (the smallest payload) is still a NaN: the result is
    # ATen's NaN, wherever the NaN sits (a vector's lane or the tail).
    x = torch.randn(40003, generator=torch.Generator().manual_seed(24)).to(dtype)
    ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
    x.view(ints)[where] = 0x7F81 if dtype == torch.bfloat16 else 0x7F800001
    assert torch.isnan(torch.max(torch.abs(x)))
    assert_amax_in_one_region_with_cpu_bits(x)


@pytest.mark.parametrize("n", [45, 40003])
@pytest.mark.parametrize("where", ["first", "middle", "last", "first half", "second half"])
@pytest.mark.parametrize("base", [0.0, -0.0], ids=["+0", "-0"])
def test_a_max_of_signed_zeros_takes_atens_bits(cast_fusion_on, n, where, base):
    # +0 and -0 compare equal: which one a max returns depends on its order, ATen's walk (one
    # zero of the other sign among the rest). A max joins a region here with a cast of the
    # same tensor.
    x = torch.full((n,), base, dtype=torch.bfloat16)
    where = {"first": 0, "middle": n // 2, "last": n - 1, "first half": slice(0, n // 2),
             "second half": slice(n // 2, n)}[where]
    x[where] = -base
    xn = x.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    w = xn.to(torch.float32)
    m = torch.max(xn)
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    assert torch.equal(as_bits(m), as_bits(torch.max(x)))
    assert torch.equal(as_bits(w), as_bits(x.to(torch.float32)))


@pytest.mark.parametrize("n", [45, 40003])
def test_a_kept_abs_with_nans_has_atens_bits(cast_fusion_on, n):
    # Every element a NaN with a payload: ATen's vector path keeps payloads, its scalar tails
    # (in each thread's range) canonicalize them; the redo gives exactly that mix.
    g = torch.Generator().manual_seed(11)
    x = (torch.randint(1, 0x80, (n,), generator=g, dtype=torch.int32) | 0x7F80
         | (torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 15)).to(torch.int16).view(torch.bfloat16)
    xn = x.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    a = torch.abs(xn)
    m = torch.max(a)
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    want = torch.abs(x)
    assert torch.equal(a.cpu().view(torch.int16), want.view(torch.int16))
    assert torch.equal(m.cpu().view(torch.int16), torch.max(want).view(torch.int16))


def test_an_abs_without_a_max_after_it_has_atens_bits(cast_fusion_on):
    # The abs joins a region with a cast of the same elements and meets NaNs: its stored
    # result is redone through ATen's kernel.
    x = nan_bf16(4096, seed=12)
    xn = x.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["tiled"]
    a = torch.abs(xn)
    w = xn.to(torch.float32)
    torch.neuron.synchronize()
    assert engine.stats()["tiled"] - before == 1
    assert torch.equal(a.cpu().view(torch.int16), torch.abs(x).view(torch.int16))
    assert torch.equal(as_bits(w), as_bits(x.to(torch.float32)))


def test_an_abs_read_by_other_than_a_max_ends_the_region(cast_fusion_on):
    # A cast of the abs would see the NaN bits a redo replaces: the region ends before it.
    x = nan_bf16(4096, seed=13)
    xn = x.to("neuron")
    torch.neuron.synchronize()
    before = engine.stats()["fused"]
    y = torch.abs(xn).to(torch.float32)
    torch.neuron.synchronize()
    assert engine.stats()["fused"] == before
    assert torch.equal(as_bits(y), as_bits(torch.abs(x).to(torch.float32)))


def test_an_intermediate_whose_memory_was_allocated_again_is_not_stored(cast_fusion_on):
    # y is dropped and its block handed to z before the queue runs: y's values can reach
    # nobody, so the fused pass leaves the block as it was (a sentinel), where storing y would
    # have overwritten it.
    n = 1 << 16
    x = torch.randn(n, dtype=torch.bfloat16, device="neuron")
    s = torch.tensor(2.0, device="neuron")
    sentinel = torch.full((n,), 7.0, device="neuron")
    torch.neuron.synchronize()
    block = sentinel.data_ptr()
    del sentinel
    y = x.to(torch.float32)
    if y.data_ptr() != block:
        pytest.skip("the allocator did not hand the sentinel's block to y")
    m = y * s
    del y
    z = torch.empty(n, device="neuron")
    f = m.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    torch.neuron.synchronize()
    assert z.data_ptr() == block
    assert torch.equal(z.cpu(), torch.full((n,), 7.0))
    assert torch.equal(as_bits(f), as_bits(scaling_cast(x.cpu(), s.cpu(), torch.float8_e4m3fn)))


def test_an_abs_of_a_value_the_region_computes_ends_the_region(cast_fusion_on):
    # A redo recomputes an abs from its input's memory; a product the region computes and
    # drops is never stored there, so the abs must not join the product's region.
    x = nan_bf16(40003, seed=14)
    xn, sn = x.to("neuron"), torch.tensor(3.0, device="neuron")
    torch.neuron.synchronize()
    got = torch.max(torch.abs(xn.to(torch.float32) * sn))
    want = torch.max(torch.abs(x.to(torch.float32) * torch.tensor(3.0)))
    assert torch.equal(as_bits(got), as_bits(want))


def test_an_intermediate_a_kernel_after_the_region_reads_is_stored(cast_fusion_on):
    # y is dropped only after a sum (no record: it ends the region) was queued to read it.
    x = hard_bf16(8192, seed=15)
    xn, sn = x.to("neuron"), torch.tensor(0.5, device="neuron")
    y = xn.to(torch.float32)
    m = y * sn
    total = y.sum()
    del y
    want = x.to(torch.float32)
    assert torch.equal(as_bits(total), as_bits(want.sum()))
    assert torch.equal(as_bits(m), as_bits(want * torch.tensor(0.5)))


def test_an_intermediate_another_stream_reads_is_stored(cast_fusion_on):
    # y is read on a second stream (record_stream), which may run after the fused region: its
    # free is not a free for the fuser, so the fused pass stores it.
    x = torch.randn(8192, dtype=torch.bfloat16)
    xn, sn = x.to("neuron"), torch.tensor(2.0, device="neuron")
    torch.neuron.synchronize()
    side = torch.neuron.Stream()
    y = xn.to(torch.float32)
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):
        z = y + 1.0
    y.record_stream(side)
    f = (y * sn).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    del y
    torch.neuron.synchronize()
    assert torch.equal(as_bits(z), as_bits(x.to(torch.float32) + 1.0))
    assert torch.equal(as_bits(f), as_bits(scaling_cast(x, torch.tensor(2.0), torch.float8_e4m3fn)))


def test_a_copy_into_a_maxs_input_after_it_ends_the_region(cast_fusion_on):
    # A redo (zero result) reads the max's input after the pass: a later cast into it must
    # not join the region.
    x = torch.zeros(4096)
    x[::2] = -0.0
    src = torch.randn(4096, dtype=torch.bfloat16)
    xn, srcn = x.to("neuron"), src.to("neuron")
    w = xn * torch.tensor(1.0, device="neuron")
    m = torch.max(xn)
    xn.copy_(srcn)
    torch.neuron.synchronize()
    assert torch.equal(as_bits(m), as_bits(torch.max(x)))
    assert torch.equal(as_bits(xn), as_bits(src.to(torch.float32)))
