"""The update's options and safeguards, each one call `grpo_step` makes behind one `if`; why each exists:
docs/06-train.md, docs/06-beyond-torl.md, and for the two that serve memory on a GPU docs/06-scaling.md.
"""
from __future__ import annotations

import math

import torch

from update_metrics import masked_mean


TIS_MODES = ("truncate", "token-mask", "sequence-mask")


def tis_weights(old_logprobs: torch.Tensor, batch, cap: float, mode: str = "truncate"
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights for the sampler/trainer gap, one per token in the loss, and their metrics. "truncate":
    min(pi_old / pi_sampler, cap); the masks give 1 or 0. `cap` > 0: grpo_step calls it only with one."""
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
    """Weight 0 outside the band [1/cap, cap], 1 inside: per token ("token-mask") or per sequence on its
    geometric-mean ratio ("sequence-mask")."""
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


def first_minibatch_gives_pi_old(cfg) -> bool:
    """Whether the first mini-batch's own forwards, detached, are pi_old for its rows (the weights have not moved
    yet): not with importance sampling, whose weights need every row's pi_old before the first forward."""
    return cfg.tis_cap <= 0


def old_pass_share(cfg) -> float:
    """The share of the update's rows whose pi_old takes a forward of its own (the dry run prices it)."""
    return (cfg.num_minibatches - 1) / cfg.num_minibatches if first_minibatch_gives_pi_old(cfg) else 1.0


def zero_gradients(model) -> None:
    """Zero gradients where no backward ran (every row skipped): AdamW then steps as it would have unskipped
    (momentum, weight decay), where a parameter without a gradient would not move at all."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def set_gradient_checkpointing(model, on: bool) -> None:
    """Keep only each decoder layer's input and recompute the layer in backward, or keep every activation."""
    if on and not model.is_gradient_checkpointing:
        # non-reentrant: works when the inputs (token ids) need no gradient
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif not on and model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


def make_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """AdamW's moments and step count, the zeros it makes itself at its first step, made now: before vLLM takes its
    share of the GPU, not inside the update's fragmented memory (docs/06-scaling.md)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            on_device = group["fused"] or group["capturable"]
            step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not group["fused"] else torch.float32
            optimizer.state[p] = {"step": torch.zeros((), dtype=step_dtype, device=p.device if on_device else "cpu"),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
