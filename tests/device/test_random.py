"""Random numbers: Philox (seed, offset) generators, exact words against an independent numpy
Philox4x32-10, the slice/offset contract DTensor relies on, state layout, distributions
(statistically), checkpoint and fork_rng, thread safety."""

import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

DEV = "neuron"

# ---- an independent Philox4x32-10 (Salmon et al., SC'11; Random123's philox4x32_10) ---------
_MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(ctr: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """ctr: (n, 4) counters -> (n, 4) uint32 output blocks."""
    c = [ctr[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _MASK, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _MASK]
        k0 = (k0 + np.uint64(0x9E3779B9)) & _MASK
        k1 = (k1 + np.uint64(0xBB67AE85)) & _MASK
    return np.stack(c, axis=1).astype(np.uint32)


def words(seed: int, offset: int, n: int, subsequence: int = 0) -> np.ndarray:
    """curand's layout: the word at offset position p is lane p % 4 of block p // 4."""
    pos = np.arange(offset, offset + n, dtype=np.uint64)
    blocks = pos // np.uint64(4)
    ctr = np.stack([blocks & _MASK, blocks >> np.uint64(32),
                    np.full(n, subsequence, np.uint64), np.zeros(n, np.uint64)], axis=1)
    out = philox4x32_10(ctr, (seed & 0xFFFFFFFF, seed >> 32))
    return out[np.arange(n), (pos % np.uint64(4)).astype(np.int64)]


def state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def test_reference_philox_matches_the_published_known_answers():
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, expect in kat:
        got = philox4x32_10(np.array([ctr], dtype=np.uint64), key)[0]
        assert tuple(int(v) for v in got) == expect


# ---- exact words ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 33, 5000])  # scalar tail, one AVX2 step, many chunks
def test_random_words_are_philox_words_at_the_generator_offset(n):
    seed = 0x1234_5678_9ABC_DEF0
    torch.neuron.set_rng_state(state(seed, 40))
    # random_(0, 2**32) on int64 keeps the low 32 bits of the 64-bit draw: subsequence 0's word.
    got = torch.empty(n, dtype=torch.int64, device=DEV).random_(0, 2**32).cpu().numpy()
    np.testing.assert_array_equal(got.astype(np.uint32), words(seed, 40, n))


@pytest.mark.parametrize("threads", (1, 2))
def test_words_of_many_tasks_are_philox_words_on_any_number_of_threads(threads):
    # 200,000 elements: several parallel tasks of 32,768 (random.cpp's kGrain chunks).
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seed, n = 0x0BAD_5EED, 200_000
        torch.neuron.set_rng_state(state(seed, 8))
        got = torch.empty(n, dtype=torch.int64, device=DEV).random_(0, 2**32).cpu().numpy()
        np.testing.assert_array_equal(got.astype(np.uint32), words(seed, 8, n))
        torch.neuron.set_rng_state(state(seed, 8))
        u1 = torch.rand(n, device=DEV).cpu()
        torch.set_num_threads(3 - threads)
        torch.neuron.set_rng_state(state(seed, 8))
        assert torch.equal(torch.rand(n, device=DEV).cpu(), u1)
    finally:
        torch.set_num_threads(was)


def test_words_carry_across_the_32_bit_block_counter():
    # Block indices 2**32 - 40 ... 2**32 + 1210: the low counter word wraps inside a vector step.
    seed, offset, n = 7, 4 * (2**32 - 40), 5000
    torch.neuron.set_rng_state(state(seed, offset))
    got = torch.empty(n, dtype=torch.int64, device=DEV).random_(0, 2**32).cpu().numpy()
    np.testing.assert_array_equal(got.astype(np.uint32), words(seed, offset, n))


def test_full_range_random_combines_subsequences_0_and_1():
    seed, n = 99, 300
    torch.neuron.set_rng_state(state(seed, 8))
    got = torch.empty(n, dtype=torch.int64, device=DEV).random_(-2**63, None).cpu().numpy().view(np.uint64)
    expect = (words(seed, 8, n, 1).astype(np.uint64) << np.uint64(32)) | words(seed, 8, n, 0)
    np.testing.assert_array_equal(got, expect)


def test_float_uniform_is_the_low_24_bits_of_each_word():
    torch.manual_seed(5)
    got = torch.rand(1000, device=DEV).cpu().numpy()
    expect = (words(5, 0, 1000) & np.uint32(0xFFFFFF)).astype(np.float32) * np.float32(2.0**-24)
    np.testing.assert_array_equal(got, expect)


def test_double_uniform_is_53_bits_of_two_subsequences():
    torch.manual_seed(6)
    got = torch.rand(777, dtype=torch.float64, device=DEV).cpu().numpy()
    v = (words(6, 0, 777, 1).astype(np.uint64) << np.uint64(32)) | words(6, 0, 777, 0)
    np.testing.assert_array_equal(got, (v & np.uint64(2**53 - 1)).astype(np.float64) * 2.0**-53)


def test_normal_is_box_muller_on_word_pairs():
    torch.manual_seed(7)
    n = 1001
    got = torch.randn(n, device=DEV).cpu().numpy().astype(np.float64)
    w = words(7, 0, n + 1).astype(np.float64)
    u1 = 1.0 - np.floor(w[0::2] / 256) * 2.0**-24
    u2 = np.floor(w[1::2] / 256) * 2.0**-24
    r = np.sqrt(-2 * np.log(u1))
    expect = np.empty(n + 1)
    expect[0::2], expect[1::2] = r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)
    np.testing.assert_allclose(got, expect[:n], rtol=2e-6, atol=2e-6)


def test_bernoulli_and_dropout_mask_compare_words_with_p_times_2_32():
    torch.manual_seed(8)
    x = torch.full((3000,), 0.3, device=DEV)
    got = torch.bernoulli(x).cpu().numpy()
    np.testing.assert_array_equal(got, (words(8, 0, 3000) < 0.3 * 2**32).astype(np.float32))
    torch.manual_seed(8)
    out, mask = torch.native_dropout(torch.ones(3000, device=DEV), 0.25, True)
    keep = words(8, 0, 3000) < 0.75 * 2**32
    np.testing.assert_array_equal(mask.cpu().numpy(), keep)
    np.testing.assert_array_equal(out.cpu().numpy(), keep.astype(np.float32) * np.float32(1 / 0.75))


# ---- the offset contract (what DTensor's OffsetBasedRNGTracker relies on) --------------------
SLICED_OPS = {
    "rand": lambda n: torch.rand(n, device=DEV),
    "rand_f64": lambda n: torch.rand(n, device=DEV, dtype=torch.float64),
    "rand_bf16": lambda n: torch.rand(n, device=DEV, dtype=torch.bfloat16),
    "randn": lambda n: torch.randn(n, device=DEV),
    "randn_f64": lambda n: torch.randn(n, device=DEV, dtype=torch.float64),
    "randint": lambda n: torch.randint(0, 1000, (n,), device=DEV),
    "randint_wide": lambda n: torch.randint(0, 2**40, (n,), device=DEV),
    "bernoulli": lambda n: torch.bernoulli(torch.full((n,), 0.4, device=DEV)),
    "dropout": lambda n: F.dropout(torch.ones(n, device=DEV), 0.3),
    "exponential": lambda n: torch.empty(n, device=DEV).exponential_(2.0),
    "geometric": lambda n: torch.empty(n, device=DEV).geometric_(0.3),
    "log_normal": lambda n: torch.empty(n, device=DEV).log_normal_(0.0, 0.5),
    "cauchy": lambda n: torch.empty(n, device=DEV).cauchy_(),
    "normal_tensor_mean": lambda n: torch.normal(torch.full((n,), 2.0, device=DEV), 3.0),
    "normal_tensor_std": lambda n: torch.normal(1.0, torch.full((n,), 3.0, device=DEV)),
    "gamma": lambda n: torch._standard_gamma(torch.full((n,), 0.7, device=DEV)),
    "poisson": lambda n: torch.poisson(torch.full((n,), 12.0, device=DEV)),
    "binomial": lambda n: torch.binomial(torch.full((n,), 20.0, device=DEV), torch.full((n,), 0.3, device=DEV)),
    "rrelu": lambda n: F.rrelu(-torch.ones(n, device=DEV), training=True),
}


@pytest.mark.parametrize("op", sorted(SLICED_OPS))
def test_a_slice_is_the_same_op_at_offset_plus_slice_start(op):
    fn, n, start = SLICED_OPS[op], 1200, 520  # start: a multiple of 4, inside a later chunk
    torch.neuron.set_rng_state(state(11, 64))
    full = fn(n).cpu()
    after_full = torch.neuron.get_rng_state().view(torch.int64)[1].item()
    torch.neuron.set_rng_state(state(11, 64 + start))
    part = fn(n - start).cpu()
    assert torch.equal(part, full[start:])
    assert after_full == 64 + n  # the offset advances by numel (rounded up to 4)


def test_non_contiguous_outputs_are_numbered_in_row_major_order():
    torch.manual_seed(3)
    ref = torch.rand(6, 5, device=DEV).cpu()
    torch.manual_seed(3)
    t = torch.empty(5, 6, device=DEV).t()
    t.uniform_()
    assert torch.equal(t.cpu(), ref)


# ---- generator state -----------------------------------------------------------------------
def test_state_is_cudas_16_byte_seed_and_offset():
    torch.neuron.manual_seed(1234)
    s = torch.neuron.get_rng_state()
    assert s.dtype == torch.uint8 and s.device.type == "cpu" and s.numel() == 16
    assert s.view(torch.int64).tolist() == [1234, 0]
    torch.rand(10, device=DEV)
    assert torch.neuron.get_rng_state().view(torch.int64).tolist() == [1234, 12]
    torch.randn(3, 4, device=DEV)
    assert torch.neuron.get_rng_state().view(torch.int64).tolist() == [1234, 24]


def test_rng_state_round_trip():
    torch.neuron.manual_seed(0)
    torch.rand(5, device=DEV)
    saved = torch.neuron.get_rng_state()
    a = torch.rand(10, device=DEV).cpu()
    torch.neuron.set_rng_state(saved)
    assert torch.equal(torch.rand(10, device=DEV).cpu(), a)
    states = torch.neuron.get_rng_state_all()
    assert len(states) == torch.neuron.device_count()
    torch.neuron.set_rng_state_all(states)
    assert all(torch.equal(x, y) for x, y in zip(states, torch.neuron.get_rng_state_all()))


def test_set_state_rejects_a_wrong_size_and_an_unaligned_offset():
    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        torch.neuron.set_rng_state(torch.zeros(5056, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="offset must be a multiple of 4"):
        torch.neuron.set_rng_state(state(1, 6))
    with pytest.raises(RuntimeError, match="offset must be a multiple of 4"):
        torch.Generator(device=DEV).set_offset(3)


def test_generator_offset_accessors():
    g = torch.Generator(device=DEV).manual_seed(9)
    assert g.get_offset() == 0
    torch.rand(5, device=DEV, generator=g)
    assert g.get_offset() == 8
    g.set_offset(100)
    assert g.get_state().view(torch.int64).tolist() == [9, 100]


def test_graphsafe_state_is_shared_and_round_trips():
    g = torch.Generator(device=DEV).manual_seed(21)
    view = g.graphsafe_get_state()
    torch.rand(8, device=DEV, generator=g)
    assert view.get_offset() == 8  # one shared (seed, offset)
    other = torch.Generator(device=DEV).manual_seed(5)
    g.graphsafe_set_state(other)
    a = torch.rand(4, device=DEV, generator=g).cpu()
    assert other.get_offset() == 4
    b = torch.rand(4, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)).cpu()
    assert torch.equal(a, b)
    clone = g.clone_state()
    assert torch.equal(clone.get_state(), g.get_state())
    torch.rand(4, device=DEV, generator=clone)
    assert clone.get_offset() == g.get_offset() + 4  # a clone is independent


def test_a_cpu_generator_is_rejected_with_cudas_message():
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but found 'cpu'"):
        torch.rand(3, device=DEV, generator=torch.Generator())
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator"):
        torch.ones(3, device=DEV).bernoulli_(0.5, generator=torch.Generator())


def test_every_cpu_random_kernel_has_a_neuron_kernel():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    missing = []
    for s in torch._C._jit_get_all_schemas():
        if not s.name.startswith("aten::") or not any("Generator" in str(a.type) for a in s.arguments):
            continue
        name = s.name + (f".{s.overload_name}" if s.overload_name else "")
        try:
            cpu = has(name, "CPU")
        except RuntimeError:  # schemas without a dispatcher entry (aten::_no_grad_normal_, ...)
            continue
        if cpu and not has(name, "PrivateUse1"):
            missing.append(name)
    # Random without a Generator argument (CPU's kernel would use the CPU default generator).
    for name in ("aten::native_dropout",):
        if not has(name, "PrivateUse1"):
            missing.append(name)
    assert missing == []


def test_the_fallback_refuses_random_ops_without_a_neuron_kernel():
    # An op with a Generator argument and only a CPU kernel: run on neuron tensors by the boxed
    # fallback, it would draw from the CPU generator, so the fallback must refuse it.
    lib = torch.library.Library("tn_test_rng", "DEF")
    lib.define("draw(Tensor x, Generator? generator=None) -> Tensor")
    lib.impl("draw", lambda x, generator=None: torch.rand(x.shape, generator=generator), "CPU")
    assert torch.ops.tn_test_rng.draw(torch.ones(4)).shape == (4,)  # CPU: fine
    with pytest.raises(NotImplementedError, match="draws random numbers and has no neuron kernel"):
        torch.ops.tn_test_rng.draw(torch.ones(4, device=DEV))


# ---- seeding -------------------------------------------------------------------------------
def test_same_seed_same_numbers():
    torch.manual_seed(123)
    a = torch.randn(100, device=DEV).cpu()
    torch.manual_seed(123)
    assert torch.equal(a, torch.randn(100, device=DEV).cpu())


def test_manual_seed_is_reproducible_across_processes():
    code = ("import torch, torchneuron; torch.manual_seed(2024); "
            "print(torch.randn(6, device='neuron').tolist(), torch.randint(0, 99, (4,), device='neuron').tolist())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout for _ in range(2)]
    assert runs[0] == runs[1] and runs[0].strip()


def test_torch_manual_seed_seeds_every_device():
    torch.manual_seed(5)
    a = torch.randn(10, device="neuron:2").cpu()
    torch.neuron.manual_seed_all(5)
    assert torch.equal(a, torch.randn(10, device="neuron:2").cpu())


def test_manual_seed_affects_only_current_device_generator():
    torch.neuron.manual_seed_all(1)
    torch.neuron.manual_seed(2)
    assert torch.neuron.initial_seed() == 2
    with torch.neuron.device(1):
        assert torch.neuron.initial_seed() == 1


def test_explicit_generator_on_neuron():
    g = torch.Generator(device=DEV)
    assert g.device.type == "neuron"
    g.manual_seed(42)
    a = torch.randn(5, device=DEV, generator=g).cpu()
    g.manual_seed(42)
    assert torch.equal(torch.randn(5, device=DEV, generator=g).cpu(), a)
    g2 = torch.Generator(device=DEV).manual_seed(42)
    assert torch.equal(torch.randn(5, device=DEV, generator=g2).cpu(), a)
    assert g.initial_seed() == 42 and g.get_state().numel() == 16


def test_seed_sets_a_new_random_seed():
    torch.neuron.manual_seed_all(0)
    torch.neuron.seed()
    assert torch.neuron.initial_seed() != 0  # a random 64-bit seed is 0 with probability 2**-64
    torch.neuron.seed_all()
    seeds = {torch.neuron.random._generator(i).initial_seed() for i in range(torch.neuron.device_count())}
    assert len(seeds) == 1 and seeds != {0}  # one fresh seed shared by every device
    assert len(torch.neuron.random.default_generators) == torch.neuron.device_count()


def test_fork_rng_on_neuron():
    torch.manual_seed(0)
    with torch.random.fork_rng(device_type="neuron"):
        torch.rand(3, device=DEV)
    a = torch.rand(3, device=DEV).cpu()
    torch.manual_seed(0)
    assert torch.equal(a, torch.rand(3, device=DEV).cpu())


def test_checkpoint_preserve_rng_state_recomputes_the_same_dropout_masks():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).to(DEV)

    def block(x):
        return F.dropout(lin(x), 0.5, training=True).sum(-1)

    x = torch.randn(16, 64, device=DEV)

    def grads(use_checkpoint):
        torch.manual_seed(1)
        lin.zero_grad()
        xi = x.clone().requires_grad_(True)
        out = checkpoint(block, xi, use_reentrant=False, preserve_rng_state=True) if use_checkpoint else block(xi)
        out.sum().backward()
        return out.detach().cpu(), xi.grad.cpu(), lin.weight.grad.cpu()

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


def test_generators_are_thread_safe():
    g = torch.Generator(device=DEV).manual_seed(0)
    out = []

    def worker():
        for _ in range(50):
            out.append(torch.rand(100, device=DEV, generator=g).cpu())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 200 draws from one generator: each reserved its own offset range, so together they are
    # exactly the sequential stream.
    g.manual_seed(0)
    seq = {tuple(torch.rand(100, device=DEV, generator=g).cpu().tolist()) for _ in range(200)}
    assert {tuple(t.tolist()) for t in out} == seq


# ---- distributions (statistics with fixed seeds) -----------------------------------------------
N = 200_000


def ks(sample: torch.Tensor, cdf) -> float:
    """Kolmogorov-Smirnov distance between a sample and a continuous CDF."""
    x = np.sort(sample.double().cpu().numpy())
    f = cdf(x)
    n = len(x)
    return max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n))


KS_BOUND = 1.95 / math.sqrt(N)  # the 0.1 % critical value
_erf = np.vectorize(math.erf)


def normal_cdf(x, m=0.0, s=1.0):
    return 0.5 * (1 + _erf((x - m) / (s * math.sqrt(2))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_uniform_is_uniform_on_from_to(dtype):
    torch.manual_seed(0)
    x = torch.empty(N, device=DEV, dtype=dtype).uniform_(-2, 3)
    assert x.min().item() >= -2 and x.max().item() < 3
    tol = KS_BOUND if dtype in (torch.float32, torch.float64) else 2e-2  # coarse grids in bf16/fp16
    assert ks(x, lambda v: (v + 2) / 5) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_normal_is_normal(dtype):
    torch.manual_seed(1)
    x = torch.empty(N, device=DEV, dtype=dtype).normal_(1.5, 2.0)
    tol = KS_BOUND if dtype != torch.bfloat16 else 1e-2
    assert ks(x, lambda v: normal_cdf(v, 1.5, 2.0)) < tol


def test_complex_normal_has_half_the_variance_per_component():
    torch.manual_seed(2)
    z = torch.randn(N, dtype=torch.complex64, device=DEV).cpu()
    assert abs(z.real.var().item() - 0.5) < 0.01 and abs(z.imag.var().item() - 0.5) < 0.01


def test_normal_with_tensor_mean_and_std():
    torch.manual_seed(3)
    mean = torch.tensor([0.0, 10.0], device=DEV).repeat(N // 2)
    std = torch.tensor([1.0, 3.0], device=DEV).repeat(N // 2)
    x = torch.normal(mean, std).cpu().view(-1, 2)
    assert ks(x[:, 0], normal_cdf) < 2 * KS_BOUND
    assert ks(x[:, 1], lambda v: normal_cdf(v, 10, 3)) < 2 * KS_BOUND
    y = torch.normal(2.0, std).cpu().view(-1, 2)
    assert ks(y[:, 1], lambda v: normal_cdf(v, 2, 3)) < 2 * KS_BOUND


def test_exponential_log_normal_cauchy_geometric_distributions():
    torch.manual_seed(4)
    e = torch.empty(N, device=DEV).exponential_(2.0)
    assert e.min().item() > 0 and ks(e, lambda v: 1 - np.exp(-2 * v)) < KS_BOUND
    ln = torch.empty(N, device=DEV, dtype=torch.float64).log_normal_(0.5, 0.25)
    assert ks(ln, lambda v: normal_cdf(np.log(v), 0.5, 0.25)) < KS_BOUND
    c = torch.empty(N, device=DEV).cauchy_(1.0, 2.0)
    assert torch.isfinite(c).all() and ks(c, lambda v: 0.5 + np.arctan((v - 1) / 2) / np.pi) < KS_BOUND
    g = torch.empty(N, device=DEV).geometric_(0.25).cpu()
    assert g.min().item() >= 1 and abs(g.mean().item() - 4) < 0.05
    assert abs((g == 1).float().mean().item() - 0.25) < 0.005


def test_bernoulli_rates():
    torch.manual_seed(5)
    p = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], device=DEV).repeat(N // 5)
    b = torch.bernoulli(p).cpu().view(-1, 5).mean(0)
    assert b[0] == 0 and b[4] == 1
    assert torch.allclose(b[1:4], torch.tensor([0.1, 0.5, 0.9]), atol=0.006)
    with pytest.raises(RuntimeError, match=r"bernoulli_ expects p to be in \[0, 1\]"):
        torch.bernoulli(torch.tensor([1.5], device=DEV))


def test_dropout_keeps_1_minus_p_and_scales():
    torch.manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = torch.full((N,), 2.0, device=DEV, dtype=dtype)
        y = F.dropout(x, 0.2).cpu().float()
        kept = y != 0
        assert abs(kept.float().mean().item() - 0.8) < 0.005
        assert torch.allclose(y[kept], torch.tensor(2.0 / 0.8, dtype=dtype).float())
    assert torch.equal(F.dropout(torch.ones(4, device=DEV), 0.5, training=False).cpu(), torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_of_a_strided_input_equals_that_of_its_contiguous_copy(dtype):
    # Elements are numbered in logical order whatever the layout, and the scale is applied in
    # the accumulation type on both paths (the fused one and the strided one).
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEV).t()
    torch.manual_seed(1)
    a = F.dropout(x, 0.1)
    torch.manual_seed(1)
    b = F.dropout(x.contiguous(), 0.1)
    assert torch.equal(a.cpu(), b.cpu())
    kept = b.cpu() != 0
    ref = (x.cpu().float() * (1 / 0.9)).to(dtype)  # one rounding of x * scale
    assert torch.equal(b.cpu()[kept], ref[kept])


def test_randint_random_covers_the_range_uniformly():
    torch.manual_seed(7)
    r = torch.randint(-3, 7, (N,), device=DEV).cpu()
    counts = torch.bincount(r + 3, minlength=10).double()
    assert r.min() == -3 and r.max() == 6
    chi2 = ((counts - N / 10) ** 2 / (N / 10)).sum().item()
    assert chi2 < 27.9  # 9 degrees of freedom, 0.1 %
    big = torch.randint(0, 2**40, (N,), device=DEV).cpu()
    assert big.max().item() > 2**39 and big.min().item() >= 0
    b = torch.empty(N, dtype=torch.bool, device=DEV).random_().cpu()
    assert abs(b.float().mean().item() - 0.5) < 0.005
    h = torch.empty(N, dtype=torch.float16, device=DEV).random_().cpu()
    assert h.min() >= 0 and h.max() <= 2048


def test_randperm_is_a_permutation_and_varies():
    torch.manual_seed(8)
    for n in (0, 1, 5, 1000, 100_000):
        p = torch.randperm(n, device=DEV).cpu()
        assert torch.equal(p.sort().values, torch.arange(n))
    a, b = torch.randperm(50, device=DEV).cpu(), torch.randperm(50, device=DEV).cpu()
    assert not torch.equal(a, b)
    firsts = torch.stack([torch.randperm(4, device=DEV)[0] for _ in range(4000)]).cpu()
    assert torch.allclose(torch.bincount(firsts, minlength=4).double() / 4000, torch.full((4,), 0.25, dtype=torch.double), atol=0.03)


def test_multinomial_with_and_without_replacement():
    torch.manual_seed(9)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 0.0, 2.0]], device=DEV)
    s = torch.multinomial(probs, 50_000, replacement=True).cpu()
    freq = torch.stack([torch.bincount(row, minlength=4) for row in s]).double() / 50_000
    assert torch.allclose(freq, torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25, 0.25, 0.0, 0.5]], dtype=torch.double),
                          atol=0.01)
    w = torch.multinomial(probs, 3, replacement=False).cpu()
    assert all(len(set(row.tolist())) == 3 for row in w) and 1 not in w[0].tolist()
    first = torch.stack([torch.multinomial(probs[0], 1) for _ in range(3000)]).cpu().flatten()
    assert abs((first == 2).double().mean().item() - 0.6) < 0.03
    with pytest.raises(RuntimeError, match="invalid multinomial distribution"):
        torch.multinomial(torch.tensor([0.0, -1.0, 2.0], device=DEV), 2, replacement=True)


def test_gamma_dirichlet_poisson_binomial_moments():
    torch.manual_seed(10)
    for alpha in (0.5, 3.0):
        g = torch._standard_gamma(torch.full((N,), alpha, device=DEV)).cpu()
        assert abs(g.mean().item() - alpha) < 0.02 * max(alpha, 1) and abs(g.var().item() - alpha) < 0.06 * max(alpha, 1)
    d = torch.distributions.Dirichlet(torch.tensor([1.0, 2.0, 3.0], device=DEV)).sample((N // 10,)).cpu()
    assert torch.allclose(d.sum(-1), torch.ones(N // 10), atol=1e-5)
    assert torch.allclose(d.mean(0), torch.tensor([1 / 6, 2 / 6, 3 / 6]), atol=0.01)
    for lam in (3.0, 40.0):
        p = torch.poisson(torch.full((N,), lam, device=DEV)).cpu()
        assert abs(p.mean().item() - lam) < 0.02 * lam and abs(p.var().item() - lam) < 0.05 * lam
    b = torch.binomial(torch.full((N,), 30.0, device=DEV), torch.full((N,), 0.2, device=DEV)).cpu()
    assert abs(b.mean().item() - 6) < 0.05 and abs(b.var().item() - 4.8) < 0.15


def test_rrelu_noise_is_uniform_on_negative_inputs():
    torch.manual_seed(11)
    x = torch.cat([-torch.ones(N // 2), torch.ones(N // 2)]).to(DEV)
    noise = torch.empty_like(x)
    y = torch.ops.aten.rrelu_with_noise(x, noise, 0.1, 0.3, True).cpu()
    n = noise.cpu()
    assert torch.all(n[N // 2:] == 1) and torch.equal(y[N // 2:], torch.ones(N // 2))
    slopes = n[: N // 2]
    assert slopes.min() >= 0.1 and slopes.max() < 0.3 and torch.equal(y[: N // 2], -slopes)
    assert ks(slopes, lambda v: (v - 0.1) / 0.2) < 2 * KS_BOUND
    ev = F.rrelu(torch.tensor([-1.0, 2.0], device=DEV), 0.1, 0.3, training=False).cpu()
    assert torch.allclose(ev, torch.tensor([-0.2, 2.0]))


def test_sparse_normal_fills_the_values_from_the_neuron_generator():
    csr = torch.eye(5).to_sparse_csr().to(DEV)
    torch.manual_seed(4)
    got = torch.randn_like(csr)
    assert got.layout == torch.sparse_csr and got.device.type == "neuron"
    torch.manual_seed(4)
    assert torch.equal(got.values().cpu(), torch.randn(5, device=DEV).cpu())
