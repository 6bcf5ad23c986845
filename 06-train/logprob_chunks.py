"""The targets' log-probs and entropy a chunk of positions at a time, so no [B, T, vocabulary] tensor exists at once.

lm_head runs on each chunk of the final hidden states alone, and again in backward (checkpoint). The operations are
the whole form's, row by row, so on the CPU the log-probs and gradients equal it. docs/06-scaling.md prices it.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint

# Rows x positions of one chunk: its logits and float32 work are a few times this x the vocabulary (dry_run.CHUNK_BYTES)
CHUNK_TOKENS = 1024


def chunked_logprobs(hidden: torch.Tensor, head, targets: torch.Tensor, temperature: float,
                     with_entropy: bool = False):
    """Log-probs [b, T-1] of `targets` under `head(hidden)` / `temperature` (`hidden`: the final hidden states
    [b, T, hidden_size]; the last position predicts past the end), and their entropy (no gradient) if asked."""
    positions = max(1, CHUNK_TOKENS // hidden.shape[0])
    params = head.parameters() if isinstance(head, torch.nn.Module) else ()
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params))
    pieces = []
    for start, chunk in zip(range(0, targets.shape[1], positions), hidden[:, :targets.shape[1]].split(positions, dim=1)):
        args = (chunk, head, targets[:, start:start + positions], temperature, with_entropy)
        pieces.append(checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args))
    logprobs = torch.cat([logprobs for logprobs, _ in pieces], dim=1)
    return logprobs, torch.cat([entropy for _, entropy in pieces], dim=1) if with_entropy else None


def _chunk(hidden: torch.Tensor, head, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """One chunk's log-probs and entropy: its logits exist only here (bf16 on a GPU, as autocast made them)."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if hidden.device.type == "cuda" else nullcontext()
    with autocast:
        logits = head(hidden)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # logit[target] - logsumexp keeps only the logits for backward, not a log_softmax copy
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy
