"""Random moe_cte problems shared by the forward and backward tests."""

import torch

from torchneuron.nkilib import make_blocks


def moe_case(T, H, I, E, k, B, dtype, seed=0, with_dout=False):
    """moe_cte arguments for T tokens routed top-``k`` over E experts in blocks of B
    (+ ``dout`` (T+1, H) before ``B`` when ``with_dout``, as moe_cte_bwd takes them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T + 1, H, generator=g).to(dtype)
    probs = torch.randn(T, E, generator=g).softmax(-1)
    topv, topi = probs.topk(k)
    aff = torch.zeros(T + 1, E)
    aff[torch.arange(T)[:, None], topi] = topv
    gu = (torch.randn(E, H, 2, I, generator=g) / H ** .5).to(dtype)
    dw = (torch.randn(E, I, H, generator=g) / I ** .5).to(dtype)
    tp, be = make_blocks(topi, E, B, T)
    if not with_dout:
        return x, aff.reshape(-1, 1), gu, dw, tp, be, B
    dout = torch.randn(T + 1, H, generator=g).to(dtype)
    return x, aff.reshape(-1, 1), gu, dw, tp, be, dout, B
