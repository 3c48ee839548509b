"""The demo's model: a GPT-style decoder (token + position embeddings, pre-norm transformer blocks
with causal attention, a linear head producing next-token logits)."""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``. ``blocks`` is a ModuleList, so
    FSDP2 can shard each block on its own."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_model(args: argparse.Namespace) -> GPT:
    """The GPT the flags describe (``--vocab``, ``--d-model``, ``--heads``, ``--layers``, ``--seq-len``)."""
    return GPT(args.vocab, args.d_model, args.heads, args.layers, args.seq_len)
