"""What `grpo_step` reports (docs/06-train.md, "Metrics"): token means over the loss mask, the sampler/trainer gap,
and the update's sums. The clip fractions are over `loss_tokens`, skipped rows' too: advantage 0 is never clipped.
"""
from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of `values` where `mask` is true; 0 when it is nowhere true."""
    n = int(mask.sum())
    return float(torch.where(mask, values.float(), 0.0).sum() / n) if n else 0.0


def sampler_mismatch(old_logprobs: torch.Tensor, entropy: torch.Tensor, batch) -> dict[str, float]:
    """Entropy of the policy before the step, and how far vLLM's recorded log-probs are from the trainer's, over
    `batch`'s loss mask (grpo_step's: the rows its update runs)."""
    mask = batch.loss_mask.bool()
    if not mask.any():  # every row skipped: undefined (null in metrics.jsonl), where 0 would read as perfect
        return dict.fromkeys(("entropy", "mismatch_abs", "mismatch_max", "mismatch_kl"), float("nan"))
    gap = torch.where(mask, old_logprobs - batch.sampler_logprobs, 0.0)
    return {"entropy": masked_mean(entropy, mask), "mismatch_abs": masked_mean(gap.abs(), mask),
            "mismatch_max": float(gap.abs().max()),
            "mismatch_kl": masked_mean(torch.expm1(gap) - gap, mask)}  # k3 of KL(sampler || trainer)


def ratio_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor, clipped_low: torch.Tensor,
                clipped_high: torch.Tensor) -> dict[str, float]:
    """A micro-batch's stats, whatever the objective: the share of model tokens the clip acted on at each side (as
    the objective means it), the token ratios and the k3 estimate of KL(old || new)."""
    with torch.no_grad():
        r = ratio.detach()
        return {"clip_low_frac": masked_mean(clipped_low, mask), "clip_high_frac": masked_mean(clipped_high, mask),
                "ratio_mean": masked_mean(r, mask), "ratio_max": float(r[mask].max()) if mask.any() else 1.0,
                "approx_kl": masked_mean((r - 1.0) - log_ratio.detach(), mask), "tokens": float(mask.sum())}


class UpdateTally:
    """Sums over a step's micro-batches and optimizer updates, turned into its metrics at the end."""

    TOKEN_MEANS = ("clip_low_frac", "clip_high_frac", "ratio_mean", "approx_kl")

    def __init__(self, batch, exclude=None) -> None:
        """`batch`: the step's, its excluded rows' loss mask zeroed."""
        self.loss = self.grad_norm = self.computed_tokens = self.ratio_max = 0.0
        self.token_weighted = dict.fromkeys(self.TOKEN_MEANS, 0.0)  # each stat times its micro-batch's tokens
        self.optimizer_steps = self.skipped_steps = self.rows_skipped = 0
        in_loss = batch.loss_mask.bool()
        self.loss_tokens = float(in_loss.sum())
        # the factor by which zero-advantage rows shrink a token-mean step (docs/06-beyond-torl.md)
        informative = float(in_loss[batch.rows_with_gradient()].sum())
        self.step_metrics = {"sequences": float(len(in_loss)), "excluded_sequences": float(sum(map(bool, exclude or ()))),
                             "tokens": self.loss_tokens, "informative_frac": informative / max(self.loss_tokens, 1)}

    def add_micro_batch(self, loss: torch.Tensor, stats: dict[str, float]) -> None:
        self.loss += float(loss.detach())
        self.computed_tokens += stats["tokens"]
        for key in self.TOKEN_MEANS:
            self.token_weighted[key] += stats[key] * stats["tokens"]
        self.ratio_max = max(self.ratio_max, stats["ratio_max"])

    def add_update(self, grad_norm: float, stepped: bool) -> None:
        if stepped:
            self.grad_norm += grad_norm
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1

    def metrics(self, mismatch: dict[str, float]) -> dict[str, float]:
        """The step's metrics, `mismatch` (sampler_mismatch's) among them; loss and grad_norm per update."""
        computed, loss_tokens, weighted = self.computed_tokens, self.loss_tokens, self.token_weighted
        return {**self.step_metrics, **mismatch,
                "loss": self.loss / max(self.optimizer_steps + self.skipped_steps, 1),
                "grad_norm": self.grad_norm / max(self.optimizer_steps, 1),
                **{key: weighted[key] / max(loss_tokens, 1) for key in ("clip_low_frac", "clip_high_frac")},
                "ratio_mean": weighted["ratio_mean"] / computed if computed else 1.0,
                "ratio_max": self.ratio_max if computed else 1.0,
                "approx_kl": weighted["approx_kl"] / max(computed, 1.0), "computed_tokens": computed,
                "rows_skipped": float(self.rows_skipped), "optimizer_steps": float(self.optimizer_steps),
                "skipped_steps": float(self.skipped_steps)}
