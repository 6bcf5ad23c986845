"""The update's options and safeguards: `UpdateRun`, whose calls `grpo_step` makes at its edge.

Each changes one thing: a token weight (truncated or masked importance
sampling), rows kept out of the loss (`exclude`), rows not run (zero
advantage; under torchrun, padded to the same passes on every rank), pi_old
from the update's own forward, and whether AdamW steps (all rows skipped,
non-finite gradient). Why each exists: docs/06-train.md and docs/06-beyond-torl.md.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from distributed import full_tensor, gradients_to_none, pad_to_every_rank
from update_metrics import UpdateTally, masked_mean, sampler_mismatch


TIS_MODES = ("truncate", "token-mask", "sequence-mask")


def tis_weights(old_logprobs: torch.Tensor, batch, cap: float, mode: str = "truncate"
                ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Importance weights for the sampler/trainer gap, one per token in the loss, and their metrics: the sample
    came from the sampler, the gradient is for the trainer's policy. "truncate": min(pi_old / pi_sampler, cap);
    the masks (`masked_importance_weights`) give 1 or 0. `cap` 0: off (None, no metrics)."""
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
    sequence on its geometric-mean ratio ("sequence-mask"). A masked token still counts in the denominator."""
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


def update_gives_pi_old(cfg) -> bool:
    """Whether the update's own forward is pi_old: one mini-batch (one update, all its forwards before it)
    and no importance sampling (whose weights need pi_old before the first forward). Its log-probs, detached,
    then stand in for the old ones: a ratio of exactly 1, without a forward of their own (2N of 10N a token)."""
    return cfg.num_minibatches == 1 and cfg.tis_cap <= 0


class UpdateRun:
    """One `grpo_step`'s options and safeguards (the module's list), each a call the step makes at its edge."""

    def __init__(self, model, batch, trajectories, cfg, exclude) -> None:
        self.model, self.batch, self.cfg, self.tally = model, batch, cfg, UpdateTally()
        # Excluded rows: no token gets gradient or counts in the denominator (DAPO's overlong filtering,
        # SimpleTIR's void turns); the mismatch metrics still cover them.
        self.scored = batch
        if exclude is not None and any(exclude):
            kept = ~torch.tensor([bool(e) for e in exclude])[:, None]
            self.scored = replace(batch, loss_mask=batch.loss_mask * kept, advantages=batch.advantages * kept)
        self.loss_tokens = float(self.scored.loss_mask.bool().sum())
        # A row adds to the gradient with a non-zero advantage and a token in the loss.
        advantage = torch.tensor([float(t.advantage) for t in trajectories])
        self.has_gradient = (advantage != 0) & self.scored.loss_mask.bool().any(dim=1)
        self.one_forward = update_gives_pi_old(cfg)
        self.step_metrics = {"sequences": float(len(trajectories)),
                             "excluded_sequences": float(sum(bool(e) for e in exclude or ()))}

    def rows_for_the_old_pass(self) -> torch.Tensor:
        """One bool per row: does it need a forward for pi_old? Every row, unless the update's forward gives
        pi_old (`update_gives_pi_old`); then only the rows it skips, for the entropy and mismatch metrics."""
        if not self.one_forward:
            return torch.ones_like(self.has_gradient)
        return ~self.has_gradient if self.cfg.skip_zero_advantage else torch.zeros_like(self.has_gradient)

    def set_pi_old(self, old_logprobs: torch.Tensor, entropy: torch.Tensor) -> None:
        """pi_old's log-probs and entropies (on CPU, [B, T-1]), and the importance weights they give."""
        self.old, self.entropy = old_logprobs, entropy
        self.weights, tis_metrics = tis_weights(old_logprobs, self.scored, self.cfg.tis_cap, self.cfg.tis_mode)
        self.step_metrics.update(tokens=self.loss_tokens, **tis_metrics)
        # Token-mean divides by every token in the loss, informative or not: this share is the
        # factor by which zero-advantage rows shrink the step (docs/06-beyond-torl.md, the exercise).
        informative = float(self.scored.loss_mask.bool()[self.has_gradient].sum())
        self.step_metrics["informative_frac"] = informative / max(self.loss_tokens, 1)

    def passes(self, rows: torch.Tensor) -> list[tuple[torch.Tensor, bool, bool]]:
        """A mini-batch's forward/backward passes, as (rows, counts, last). Rows without gradient are skipped
        (GRPOConfig.skip_zero_advantage) yet count in grpo_step's denominator, so the update is the same. Under
        DDP or FSDP2 the passes are padded to every rank's number (`pad_to_every_rank`) with ones that do not
        count: the mini-batch's shortest row, its loss times 0. One process: none when every row is skipped."""
        run = rows
        if self.cfg.skip_zero_advantage:
            run = rows[self.has_gradient[rows]]
            self.tally.rows_skipped += int((~self.has_gradient[rows]).sum())
        micro_batches = [(micro_rows, True) for micro_rows in run.split(self.cfg.micro_batch_size)] if len(run) else []
        micro_batches = pad_to_every_rank(self.model, micro_batches, (rows[-1:], False))
        self.ran = bool(micro_batches)
        return [(micro_rows, counts, i == len(micro_batches) - 1) for i, (micro_rows, counts) in enumerate(micro_batches)]

    def old_logprobs(self, rows: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        """pi_old's log-probs of `rows`, on the forward's device; where the update's forward is pi_old, its
        log-probs, detached (and its entropy, for the metrics)."""
        width = logprobs.shape[1]
        if self.one_forward:
            self.old[rows, :width], self.entropy[rows, :width] = logprobs.detach().cpu(), entropy.cpu()
        return self.old[rows, :width].to(logprobs.device)

    def token_weights(self, rows: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor | None:
        """The importance weights of `rows` (None without importance sampling)."""
        return None if self.weights is None else self.weights[rows, :logprobs.shape[1]].to(logprobs.device)

    def add(self, loss: torch.Tensor, stats: dict[str, float], counts: bool) -> None:
        if counts:
            self.tally.add_micro_batch(loss, stats)

    def step(self, optimizer) -> None:
        """Clip the gradient's norm and step, unless the norm is NaN or inf: such a gradient would poison
        every weight it touches. With every row skipped AdamW gets the zero gradients backward would have
        left, so it still steps (momentum, weight decay), as it would unskipped."""
        model = self.model
        if not self.ran:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm)).item()
        stepped = math.isfinite(grad_norm)
        if stepped:
            optimizer.step()
        self.tally.add_update(grad_norm, stepped=stepped)
        optimizer.zero_grad(set_to_none=gradients_to_none(model))

    def metrics(self) -> dict[str, float]:
        return {**self.step_metrics, **sampler_mismatch(self.old, self.entropy, self.batch),
                **self.tally.metrics(self.loss_tokens)}
