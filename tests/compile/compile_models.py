"""Tiny models and helpers for the compile tests (importable: pytest puts this dir on sys.path)."""

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = torch.device("neuron:0")


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.silu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class GPTBlock(nn.Module):
    """Pre-norm transformer block with causal SDPA attention."""

    def __init__(self, d=32, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


def clone_to(model, device):
    return copy.deepcopy(model).to(device)


def assert_close(actual, expected, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), atol=atol, rtol=rtol)


def attention_reference(q, k, v, mask=None, score_mod=None, scale=None):
    """Explicit-math attention on CPU (float64) used as the FlexAttention oracle.
    ``mask``: bool [Lq, Lkv] or [B, H, Lq, Lkv]; ``score_mod``: f(scores, b, h, q, kv)."""
    q, k, v = (t.cpu().double() for t in (q, k, v))  # keeps autograd history
    if k.size(1) != q.size(1):  # GQA
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    s = q @ k.transpose(-2, -1) * scale
    if score_mod is not None:
        B, H, Lq, Lk = s.shape
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        qi = torch.arange(Lq).view(1, 1, Lq, 1)
        ki = torch.arange(Lk).view(1, 1, 1, Lk)
        s = score_mod(s, b, h, qi, ki)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v
