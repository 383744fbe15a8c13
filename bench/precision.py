"""Dtype speed sweep on neuron: the GEMM family and common training ops in fp32, bf16, fp16 and
fp8/int8 where defined, each printed as a ratio to its bf16 time measured in the same run.

Targets (issue 16): no fp16 op above 1.5x its bf16 time; fp8 ``torch._scaled_mm`` at most 1.0x a
bf16 matmul of the same shape; the fp16-AMP (GradScaler) training step of the demo GPT at most
1.2x its bf16-autocast step. The CPU column is the same op and dtype on native CPU (fewer
rounds; the pre-routing neuron figures were CPU's, since neuron ran CPU's kernels).

The fp8 cast round trip has no target (its ratio is to a bf16 copy); it shows the cast cost
that bounds torchao's float8 training.

Usage: python bench/precision.py [--quick] [--no-cpu] [--threads N] [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, CharDataset, GPTConfig  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device: str) -> None:
    if device != "cpu":
        torch.accelerator.synchronize()


def timed(fn, inner: int, device: str) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - start) / inner


def calibrate(fn, device: str, budget: float = 0.02) -> tuple[int, float]:
    """Warm up and choose how many calls make one sample of about ``budget`` seconds."""
    first = timed(fn, 1, device)
    if first > 0.5:
        return 1, first
    t = timed(fn, 1, device)
    return max(1, int(budget / max(t, 1e-7))), t


def measure(fns: dict, device: str, rounds: int) -> dict:
    """Interleave the candidates round by round (drift and noise hit all alike); per candidate
    the list of per-call times, one per round."""
    inner = {}
    for k, fn in fns.items():
        n, first = calibrate(fn, device)
        inner[k] = n
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            # Very slow candidates (seconds per call) get fewer rounds.
            if samples[k] and inner[k] == 1 and samples[k][0] > 0.5 and len(samples[k]) >= 3:
                continue
            samples[k].append(timed(fn, inner[k], device))
    return samples


# ---- cases: make(device, dtype) -> zero-argument callable, or None where undefined -----------
def mm_case(n):
    def make(dev, dt):
        a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
        return lambda: a @ b
    return make


def linear_case(dev, dt):
    x = torch.randn(64, 512, device=dev, dtype=dt)
    w, b = torch.randn(512, 512, device=dev, dtype=dt), torch.randn(512, device=dev, dtype=dt)
    return lambda: F.linear(x, w, b)


def linear_train_case(dev, dt):
    x = torch.randn(64, 512, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(512, 512, device=dev, dtype=dt, requires_grad=True)
    b = torch.randn(512, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(64, 512, device=dev, dtype=dt)

    def step():
        F.linear(x, w, b).backward(g)
        x.grad = w.grad = b.grad = None
    return step


def bmm_case(dev, dt):
    a = torch.randn(8, 128, 128, device=dev, dtype=dt)
    return lambda: torch.bmm(a, a)


def baddbmm_case(dev, dt):
    a, c = torch.randn(8, 128, 128, device=dev, dtype=dt), torch.randn(8, 128, 128, device=dev, dtype=dt)
    return lambda: torch.baddbmm(c, a, a, beta=0.5, alpha=2.0)


def mv_case(dev, dt):
    a, v = torch.randn(1024, 1024, device=dev, dtype=dt), torch.randn(1024, device=dev, dtype=dt)
    return lambda: torch.mv(a, v)


def conv_case(dev, dt):
    x = torch.randn(8, 32, 32, 32, device=dev, dtype=dt)
    w = torch.randn(32, 32, 3, 3, device=dev, dtype=dt)
    return lambda: F.conv2d(x, w, padding=1)


def conv_train_case(dev, dt):
    x = torch.randn(8, 32, 32, 32, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(32, 32, 3, 3, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(8, 32, 32, 32, device=dev, dtype=dt)

    def step():
        F.conv2d(x, w, padding=1).backward(g)
        x.grad = w.grad = None
    return step


def sdpa_case(dev, dt):
    q = torch.randn(4, 8, 256, 64, device=dev, dtype=dt)
    return lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)


def sdpa_train_case(dev, dt):
    q, k, v = (torch.randn(4, 8, 256, 64, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(4, 8, 256, 64, device=dev, dtype=dt)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad = k.grad = v.grad = None
    return step


def grouped_mm_case(dev, dt):
    if dt == torch.float32:
        return None  # _grouped_mm takes bf16 (and fp16 on neuron) only
    offs = torch.tensor([256, 512, 768, 1024], device=dev, dtype=torch.int32)
    a = torch.randn(1024, 256, device=dev, dtype=dt)
    b = torch.randn(4, 256, 256, device=dev, dtype=dt)
    return lambda: torch._grouped_mm(a, b, offs)


def compiled_linear_case(dev, dt):
    if dev == "cpu":
        return None
    lin = torch.nn.Linear(512, 512).to(dev, dt)
    f = torch.compile(lin, backend="neuron")
    x = torch.randn(64, 512, device=dev, dtype=dt)
    return lambda: f(x)


def scaled_mm_case(n, rowwise=False, out_dtype=torch.bfloat16, m=None, k=None):
    """fp8 _scaled_mm of an m x k activation and a k x n column-major weight (m = k = n unless
    given) vs a bf16 matmul of the same shape and layout."""
    m, k = m or n, k or n

    def make(dev, dt):
        a = torch.randn(m, k, device=dev)
        b = torch.randn(k, n, device=dev)
        if dt == torch.bfloat16:  # the baseline: a bf16 matmul of the same shape and layout
            a16, b16 = a.bfloat16(), b.bfloat16().t().contiguous().t()
            return lambda: a16 @ b16
        if dt != FP8:
            return None
        a8, b8 = a.to(FP8), b.t().contiguous().to(FP8).t()  # b column-major, as _scaled_mm wants
        if rowwise:
            sa, sb = torch.rand(m, 1, device=dev) + 0.5, torch.rand(1, n, device=dev) + 0.5
        else:
            sa, sb = torch.tensor(0.5, device=dev), torch.tensor(2.0, device=dev)
        return lambda: torch._scaled_mm(a8, b8, sa, sb, out_dtype=out_dtype)
    return make


def scaled_grouped_mm_case(rows, experts, k):
    """fp8 _scaled_grouped_mm (row-wise scales, MoE layout 2d x 3d: `rows` token rows split evenly
    over `experts` k x k weights) vs the bf16 _grouped_mm."""
    def make(dev, dt):
        offs = torch.arange(rows // experts, rows + 1, rows // experts, device=dev, dtype=torch.int32)
        a = torch.randn(rows, k, device=dev)
        b = torch.randn(experts, k, k, device=dev)
        if dt == torch.bfloat16:
            a16, b16 = a.bfloat16(), b.bfloat16().transpose(-2, -1).contiguous().transpose(-2, -1)
            return lambda: torch._grouped_mm(a16, b16, offs)
        if dt != FP8 or dev == "cpu":
            return None  # CPU has no _scaled_grouped_mm kernel
        a8, b8 = a.to(FP8), b.transpose(-2, -1).contiguous().to(FP8).transpose(-2, -1)
        sa, sb = torch.rand(rows, device=dev) + 0.5, torch.rand(experts, k, device=dev) + 0.5
        return lambda: torch._scaled_grouped_mm(a8, b8, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    return make


def fp8_cast_case(dev, dt):
    """bf16 -> e4m3 -> bf16 round trip of 1024x1024 (torchao's casts) vs a bf16 -> bf16 copy."""
    x = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    if dt == torch.bfloat16:
        return lambda: x.clone()
    if dt != FP8:
        return None
    return lambda: x.to(FP8).to(torch.bfloat16)


def int_mm_case(n):
    def make(dev, dt):
        if dt == torch.bfloat16:
            a16, b16 = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
            return lambda: a16 @ b16
        if dt != torch.int8:
            return None
        a = torch.randint(-128, 128, (n, n), device=dev, dtype=torch.int8)
        b = torch.randint(-128, 128, (n, n), device=dev, dtype=torch.int8)
        return lambda: torch._int_mm(a, b)
    return make


def gpt_case(dev, dt):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = CharDataset(block_size=cfg.block_size).batch(16, torch.Generator().manual_seed(0))
    x, y = x.to(dev), y.to(dev)
    scaler = torch.amp.GradScaler(dev) if dt == torch.float16 else None
    amp = dt != torch.float32

    def step():
        with torch.autocast(dev, dtype=dt, enabled=amp):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return step


def _torchao():
    try:
        import torchao  # noqa: F401
        return True
    except ImportError:
        return False


def float8_train_case(dev, dt, input_grad=False, compiled=False):
    """torchao float8 training (tensorwise) of a bf16 MLP vs the same MLP in bf16.

    With ``input_grad`` the input requires grad, as for any MLP after the first layer of a
    network. Without it the bf16 step runs 5 GEMMs and torchao's 6: torchao's backward always
    computes the first linear's input gradient (it does not check ``needs_input_grad``).
    With ``compiled`` both models run under ``torch.compile`` (torchao's recommended use: its
    casts fuse into Inductor kernels); neuron only."""
    if dt not in (torch.bfloat16, FP8) or (compiled and dev != "neuron"):
        return None
    from torchao.float8 import convert_to_float8_training
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(2048, 1024, bias=False)).to(dev, torch.bfloat16)
    if dt == FP8:
        convert_to_float8_training(model)
    if compiled:
        model = torch.compile(model, backend="neuron")
    x = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16, requires_grad=input_grad)

    def step():
        model(x).sum().backward()
        for p in model.parameters():
            p.grad = None
        x.grad = None
    return step


def float8_train_input_grad_case(dev, dt):
    return float8_train_case(dev, dt, input_grad=True)


def float8_train_compiled_case(dev, dt):
    return float8_train_case(dev, dt, input_grad=True, compiled=True)


def int8_weight_only_case(dev, dt, m=256, k=1024, n=4096):
    """torchao Int8WeightOnlyConfig linear vs the bf16 linear (M=256 tokens, 1024->4096)."""
    if dt not in (torch.bfloat16, torch.int8):
        return None
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False).to(dev, torch.bfloat16)
    if dt == torch.int8:
        quantize_(lin, Int8WeightOnlyConfig())
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

    def step():
        with torch.no_grad():
            lin(x)
    return step


ALL = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8,
       "int8": torch.int8}

CASES = [
    # name, make, dtypes, target (name of the checked dtype, max ratio to bf16)
    ("mm 256x256", mm_case(256), ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("mm 1024x1024", mm_case(1024), ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("linear 64x512->512", linear_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("linear fwd+bwd", linear_train_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("bmm 8x128x128", bmm_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("baddbmm 8x128x128", baddbmm_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("mv 1024x1024", mv_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("conv2d 8x32x32x32 k3", conv_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("conv2d fwd+bwd", conv_train_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("SDPA 4x8x256x64 causal", sdpa_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("SDPA fwd+bwd", sdpa_train_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("_grouped_mm 1024x256, 4x256x256", grouped_mm_case, ("bf16", "fp16"), ("fp16", 1.5)),
    ("compiled linear 64x512->512", compiled_linear_case, ("fp32", "bf16", "fp16"), ("fp16", 1.5)),
    ("_scaled_mm 1024 tensorwise->bf16", scaled_mm_case(1024), ("bf16", "fp8"), ("fp8", 1.0)),
    ("_scaled_mm 1024 rowwise->bf16", scaled_mm_case(1024, rowwise=True), ("bf16", "fp8"), ("fp8", 1.0)),
    ("_scaled_mm 1024 tensorwise->fp32", scaled_mm_case(1024, out_dtype=torch.float32), ("bf16", "fp8"),
     ("fp8", 1.0)),
    ("_scaled_mm decode 16x4096->4096 rowwise", scaled_mm_case(4096, rowwise=True, m=16), ("bf16", "fp8"),
     ("fp8", 1.0)),
    ("_scaled_mm 2048 rowwise->bf16", scaled_mm_case(2048, rowwise=True), ("bf16", "fp8"), ("fp8", 1.0)),
    ("_scaled_grouped_mm 1024x512, 4x512x512", scaled_grouped_mm_case(1024, 4, 512), ("bf16", "fp8"), ("fp8", 1.0)),
    ("_scaled_grouped_mm decode 32 rows, 8x2048x2048", scaled_grouped_mm_case(32, 8, 2048), ("bf16", "fp8"),
     ("fp8", 1.0)),
    ("fp8 cast round trip 1024x1024", fp8_cast_case, ("bf16", "fp8"), None),
    ("_int_mm 1024", int_mm_case(1024), ("bf16", "int8"), ("int8", 1.0)),
    ("GPT train step (AMP)", gpt_case, ("fp32", "bf16", "fp16"), ("fp16", 1.2)),
    ("torchao float8 MLP train", float8_train_case, ("bf16", "fp8"), ("fp8", 1.0)),
    ("torchao float8 MLP train, input grad", float8_train_input_grad_case, ("bf16", "fp8"), ("fp8", 1.0)),
    ("torchao float8 MLP, compiled", float8_train_compiled_case, ("bf16", "fp8"), ("fp8", 1.0)),
    ("torchao int8 weight-only linear", int8_weight_only_case, ("bf16", "int8"), ("int8", 1.0)),
    ("torchao int8 weight-only decode 16x4096->4096",
     lambda dev, dt: int8_weight_only_case(dev, dt, 16, 4096, 4096), ("bf16", "int8"), ("int8", 1.0)),
    ("torchao int8 weight-only decode 1x4096->4096",
     lambda dev, dt: int8_weight_only_case(dev, dt, 1, 4096, 4096), ("bf16", "int8"), ("int8", 1.0)),
]


def fmt(s: float) -> str:
    return f"{s * 1e6:7.1f} us" if s < 1e-3 else f"{s * 1e3:7.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    ap.add_argument("--no-cpu", action="store_true", help="skip the native CPU column")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads (default: torch's); 1 gives stable figures on a loaded machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 3 if args.quick else 7
    import torchneuron._C as _C
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} interleaved rounds; "
          "median per call [min-max over rounds]; ratio = median / bf16 median on neuron")
    print(f"host: CPU capability {torch.backends.cpu.get_cpu_capability()}, load average "
          f"{os.getloadavg()[0]:.1f}; routes {_C._precision_routes()}")
    print(f"{'case':<36}{'dtype':>6}{'neuron':>12}{'range':>22}{'/bf16':>8}{'cpu':>12}  target")
    misses = []
    for name, make, dtypes, target in CASES:
        tdt, tmax = target or (None, None)
        if args.only and args.only not in name:
            continue
        if name.startswith("torchao") and not _torchao():
            print(f"{name:<36}  (torchao not installed: skipped)")
            continue
        fns = {d: make("neuron", ALL[d]) for d in dtypes}
        fns = {d: f for d, f in fns.items() if f is not None}
        samples = measure(fns, "neuron", rounds)
        cpu = {}
        if not args.no_cpu:
            for d in fns:
                try:
                    f = make("cpu", ALL[d])
                except Exception:  # noqa: BLE001 - an op CPU lacks is reported as such
                    f = None
                if f is None:
                    continue
                # CPU's own kernel for a dtype can be pathological (fp8 _scaled_mm tensor-wise
                # on an AMX host: ~49 s a call); one call is enough to say so.
                first = timed(f, 1, "cpu")
                cpu[d] = first if first > 1.0 else statistics.median(measure({d: f}, "cpu", 3)[d])
        base = statistics.median(samples["bf16"])
        for d, s in samples.items():
            med = statistics.median(s)
            ratio = med / base
            tgt = ""
            if d == tdt:
                ok = ratio <= tmax
                tgt = f"<= {tmax:.1f}  {'yes' if ok else 'NO'}"
                if not ok:
                    misses.append(f"{name} {d}: {ratio:.2f}")
            rng = f"[{fmt(min(s)).strip()}-{fmt(max(s)).strip()}]"
            c = fmt(cpu[d]) if d in cpu else "-"
            print(f"{name:<36}{d:>6}{fmt(med):>12}{rng:>22}{ratio:8.2f}{c:>12}  {tgt}", flush=True)
    print("targets missed: " + ("none" if not misses else "; ".join(misses)))


if __name__ == "__main__":
    main()
