"""The update's options and safeguards, one small helper each, called from `grpo_step`.

Each changes one thing: a token weight (truncated or masked importance
sampling), rows kept out of the loss (`exclude`), rows not run (zero
advantage; under torchrun, padded to the same passes on every rank), pi_old
from the update's own forward, and whether AdamW steps (all rows skipped,
non-finite gradient).
The loss's aggregations beside token-mean are objectives.py's. Why each exists:
docs/06-train.md and docs/06-beyond-torl.md.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from distributed import pad_to_every_rank
from update_metrics import masked_mean


TIS_MODES = ("truncate", "token-mask", "sequence-mask")


def tis_weights(old_logprobs: torch.Tensor, batch, cap: float, mode: str = "truncate"
                ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights for the sampler/trainer gap, one per token in the loss, and their metrics.

    The sample came from the sampler, the gradient is for the trainer's policy;
    the weight corrects for that and is never differentiated. "truncate":
    min(pi_old / pi_sampler, cap). The masks (`masked_importance_weights`) give 1
    or 0. `cap` 0: off (None, no metrics).
    """
    if cap <= 0:
        return None, {}
    mask = batch.loss_mask.bool()
    log_ratio = torch.where(mask, old_logprobs - batch.sampler_logprobs, 0.0)
    if mode != "truncate":
        return masked_importance_weights(log_ratio, mask, cap, mode)
    old_over_sampler = torch.exp(log_ratio)
    weights = torch.where(mask, old_over_sampler.clamp(max=cap), 0.0)
    return weights, {"tis_weight_mean": masked_mean(weights, mask),
                     "tis_capped_frac": masked_mean(old_over_sampler > cap, mask)}


def masked_importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cap: float, mode: str
                              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weight 0 outside the band [1/cap, cap], 1 inside: per token ("token-mask", IcePop's rule) or per
    sequence on its geometric-mean ratio ("sequence-mask"). A masked token still counts in the denominator.

    tis_masked_frac: share of tokens in the loss with weight 0; tis_masked_seq_frac: share of
    sequences in the loss with at least one (all of them, with sequence-mask).
    """
    band = math.log(cap)
    if mode == "token-mask":
        outside = log_ratio.abs() > band
    elif mode == "sequence-mask":
        per_sequence = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        outside = (per_sequence.abs() > band).expand_as(mask)
    else:
        raise ValueError(f"unknown tis_mode {mode!r} (choose from {', '.join(TIS_MODES)})")
    outside = outside & mask
    weights = (mask & ~outside).float()
    in_loss = mask.any(dim=1)
    return weights, {"tis_weight_mean": masked_mean(weights, mask), "tis_masked_frac": masked_mean(outside, mask),
                     "tis_masked_seq_frac": masked_mean(outside.any(dim=1), in_loss)}


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


def micro_batches_to_run(rows: torch.Tensor, has_gradient: torch.Tensor, model, cfg) -> tuple[list, int]:
    """A mini-batch's forward/backward passes as (rows, counts) pairs, and how many rows were skipped.

    Rows without gradient are skipped (GRPOConfig.skip_zero_advantage): a skipped row
    adds 0 to the gradient but still counts in the denominator (grpo_step's denominator
    counts every row), so the update is the same. Under DDP or FSDP2 every rank must run
    as many passes as the others, the gradient exchange happens inside them: the ranks
    agree on the most any needs (`pad_to_every_rank`), and a rank with fewer adds
    passes that do not count (counts False: the mini-batch's shortest row, its loss
    times 0, a gradient of exactly 0). One process: no padding, and none at all when
    every row is skipped.
    """
    run, skipped = rows, 0
    if cfg.skip_zero_advantage:
        run, skipped = rows[has_gradient[rows]], int((~has_gradient[rows]).sum())
    micro_batches = [(micro_rows, True) for micro_rows in run.split(cfg.micro_batch_size)] if len(run) else []
    return pad_to_every_rank(model, micro_batches, (rows[-1:], False)), skipped


def update_gives_pi_old(cfg) -> bool:
    """Whether the update's own forward is pi_old: one mini-batch (one update, all its forwards before it)
    and no importance sampling (whose weights need pi_old before the first forward). Its log-probs, detached,
    then stand in for the old ones: a ratio of exactly 1, without a forward of their own (2N of 10N a token)."""
    return cfg.num_minibatches == 1 and cfg.tis_cap <= 0


def rows_for_the_old_pass(has_gradient: torch.Tensor, skip_zero_advantage: bool, one_forward: bool) -> torch.Tensor:
    """One bool per row: does it need grpo_step's forward for pi_old? Every row, unless the update's forward
    gives pi_old (`one_forward`: `update_gives_pi_old`); then only the rows it skips, for the entropy and
    mismatch metrics."""
    if not one_forward:
        return torch.ones_like(has_gradient)
    return ~has_gradient if skip_zero_advantage else torch.zeros_like(has_gradient)


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
