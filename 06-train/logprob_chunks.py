"""The targets' log-probs and entropy a chunk of positions at a time, so no float32 [B, T, vocabulary] exists at once.

Taken whole, the float32 copy of a micro-batch's logits, logsumexp's softmax and
their gradients are each B x T x vocabulary floats: 8.4 GB each for 4 sequences
of 3,472 tokens at Qwen's 152k vocabulary. Here each chunk is computed alone and
computed again in backward (torch.utils.checkpoint), so only the model's own
logits (bf16 on a GPU) and their gradient span the micro-batch. The operations
are the whole form's, row by row, so on the CPU the log-probs and the gradients
are the same bits. docs/06-scaling.md prices what is left.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# Rows x positions of one chunk: its float32 temporaries are a few times this x the vocabulary (2.5 GB at 152k).
CHUNK_TOKENS = 1024


def chunked_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False):
    """Log-probs [b, T-1] of `targets` ([b, T-1]) under `logits` ([b, T, vocabulary]: its last position predicts
    past the end) divided by `temperature`, and their entropy (no gradient) if asked, else None."""
    positions = max(1, CHUNK_TOKENS // logits.shape[0])
    recompute = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start, chunk in zip(range(0, targets.shape[1], positions), logits.split(positions, dim=1)):
        args = (chunk, targets[:, start:start + positions], temperature, with_entropy)
        pieces.append(checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args))
    logprobs = torch.cat([logprobs for logprobs, _ in pieces], dim=1)
    return logprobs, torch.cat([entropy for _, entropy in pieces], dim=1) if with_entropy else None


def _chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    """One chunk's log-probs, and its entropy if asked."""
    logits = logits[:, : targets.shape[1]].float()  # the whole form's last position has no target
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
