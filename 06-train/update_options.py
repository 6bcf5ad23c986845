"""The update's options and safeguards, one small helper each, called from `grpo_step`.

Each changes one thing: a token weight (truncated importance sampling), rows
kept out of the loss (`exclude`), rows not run (zero advantage), the loss's
denominator (aggregation, data parallel), and whether AdamW steps (all rows
skipped, non-finite gradient). Why each exists: docs/06-train.md and docs/06-beyond-torl.md.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from distributed import is_data_parallel
from update_metrics import masked_mean


def tis_weights(old_logprobs: torch.Tensor, batch, cap: float) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated importance sampling: min(pi_old / pi_sampler, cap) per token in the loss, and its metrics.

    The sample came from the sampler, the gradient is for the trainer's policy;
    the weight corrects for that and is never differentiated. `cap` 0: off (None, no metrics).
    """
    if cap <= 0:
        return None, {}
    mask = batch.loss_mask.bool()
    trainer_over_sampler = torch.exp(torch.where(mask, old_logprobs - batch.sampler_logprobs, 0.0))
    weights = torch.where(mask, trainer_over_sampler.clamp(max=cap), 0.0)
    return weights, {"tis_weight_mean": masked_mean(weights, mask),
                     "tis_capped_frac": masked_mean(trainer_over_sampler > cap, mask)}


def exclude_rows(batch, exclude):
    """The batch with the rows marked in `exclude` out of the loss: no token gets gradient
    or counts in the denominator (DAPO's overlong filtering, SimpleTIR's void turns)."""
    if exclude is None or not any(exclude):
        return batch
    kept = ~torch.tensor([bool(e) for e in exclude])[:, None]
    return replace(batch, loss_mask=batch.loss_mask * kept, advantages=batch.advantages * kept)


def rows_with_gradient(trajectories, loss_mask: torch.Tensor) -> torch.Tensor:
    """One bool per row: a non-zero advantage and a token in the loss, so its backward adds something."""
    advantage = torch.tensor([float(t.advantage) for t in trajectories])
    return (advantage != 0) & loss_mask.bool().any(dim=1)


def skip_zero_advantage(rows: torch.Tensor, has_gradient: torch.Tensor, model, on: bool) -> tuple[torch.Tensor, int]:
    """The rows to run forward and backward on, and how many were skipped.

    A skipped row adds 0 to the gradient but still counts in the denominator
    (`loss_normalizer` sees every row), so the update is the same. Under DDP or
    FSDP2 nothing is skipped: every rank must run the same backward passes, the
    gradient exchange happens inside them.
    """
    if not on or is_data_parallel(model):
        return rows, 0
    return rows[has_gradient[rows]], int((~has_gradient[rows]).sum())


def loss_normalizer(loss_mask: torch.Tensor, aggregation: str, max_response_tokens: int, global_normalizer=None) -> float:
    """A mini-batch's loss denominator, counting all its rows: its tokens in the loss (token-mean),
    its sequences that have any (sequence-mean), or the response budget times its sequences (token-sum).

    Data parallel: `global_normalizer` (distributed.py) turns this rank's count into
    the one that makes the ranks' averaged gradient the whole batch's.
    """
    if aggregation == "token-sum":
        count = float(max_response_tokens * loss_mask.shape[0])
    elif aggregation == "token-mean":
        count = max(float(loss_mask.sum()), 1.0)
    else:
        count = max(float((loss_mask.sum(dim=1) > 0).sum()), 1.0)
    return count if global_normalizer is None else global_normalizer(count)


def zero_gradients(model) -> None:
    """All of a mini-batch's rows were skipped: give AdamW the zero gradients backward would
    have left, so it still takes its step (momentum, weight decay), as it would unskipped."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def step_if_finite(optimizer, grad_norm: float) -> bool:
    """Step, unless the gradient norm is NaN or inf: such a gradient would poison every weight it touches."""
    if not math.isfinite(grad_norm):
        return False
    optimizer.step()
    return True
