"""The demo's data: a deterministic token corpus, each rank's batch at a data position, and the
learning-rate schedule. Everything here depends only on its arguments, so a resumed run that
restores the step and data position sees exactly the batches and rates of an uninterrupted one."""

from __future__ import annotations

import argparse
import math
from typing import Any

CORPUS_SEED = 20261129


def make_corpus(vocab: int, n_tokens: int = 1 << 17) -> Any:
    """A fixed token stream: a Markov chain where each word has a few likely successors (the same
    for every run and rank; ``CORPUS_SEED``). A model can learn it: the loss falls from
    ``ln(vocab)`` towards the chain's entropy."""
    import torch

    g = torch.Generator().manual_seed(CORPUS_SEED)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choice = torch.multinomial(probs, n_tokens, replacement=True, generator=g)
    tok = 0
    succ = successors.tolist()
    tokens = []
    for c in choice.tolist():  # in Python lists: 0.27 s per rank when it wrote the tensor item by item
        tok = succ[tok][c]
        tokens.append(tok)
    return torch.tensor(tokens, dtype=torch.long)


def batch_at(corpus: Any, position: int, rank: int, batch: int, seq_len: int) -> tuple[Any, Any]:
    """Samples ``position + rank*batch .. +batch`` of the global sample order (a fixed stride
    through the corpus), as ``(inputs, targets)``."""
    import torch

    span = corpus.numel() - seq_len - 1
    starts = [((position + rank * batch + j) * 7919 * seq_len) % span for j in range(batch)]
    x = torch.stack([corpus[s:s + seq_len] for s in starts])
    y = torch.stack([corpus[s + 1:s + seq_len + 1] for s in starts])
    return x, y


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over 5 steps, then cosine decay to 10% at ``--steps``."""
    if step <= 5:
        return args.lr * step / 5
    frac = min(1.0, (step - 5) / max(1, args.steps - 5))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
