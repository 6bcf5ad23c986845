"""Every loss a run may choose beside grpo.py's PPO-clip with token-mean; the story is docs/06-beyond-torl.md.

The one place the objective and the aggregation are chosen, and GSPO and CISPO, which take the arguments of
`grpo.clipped_policy_loss` and return (loss, stats) alike. `objective_problems` refuses, one line each, the
settings that would silently train something else.
"""
from __future__ import annotations

import torch

from update_metrics import ratio_stats
from update_options import TIS_MODES

GSPO_WIDEST_EPS = 0.01  # a wider GSPO band is PPO-sized: the paper uses 3e-4 / 4e-4
AGGREGATIONS = ("token-mean", "sequence-mean", "token-sum")


def gspo_loss(logprobs, old_logprobs, advantages, loss_mask, eps_low: float = 3e-4, eps_high: float = 4e-4,
              aggregation: str = "sequence-mean", normalizer: float | None = None, token_weights=None):
    """GSPO: -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) per sequence, s_i the geometric-mean token ratio;
    always sequence-mean, `normalizer` replacing the sequence count. `token_weights` ([B, T], no gradient) weigh a
    sequence by their mean over its model tokens: with sequence-mask that is its 0 or 1."""
    if aggregation != "sequence-mean":
        raise ValueError(f"gspo averages over sequences: aggregation {aggregation!r} does not apply")
    mask = loss_mask.bool()
    tokens = mask.sum(dim=1)
    in_loss = tokens > 0
    if advantages.dim() == 2:  # the batch's [B, T] form: the sequence's advantage on each of its model tokens
        advantages = torch.where(mask, advantages, 0.0).sum(dim=1) / tokens.clamp(min=1)
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    sequence_ratio = torch.exp(log_ratio.sum(dim=1) / tokens.clamp(min=1))
    clipped = torch.clamp(sequence_ratio, 1.0 - eps_low, 1.0 + eps_high)
    terms = -torch.minimum(sequence_ratio * advantages, clipped * advantages)
    if token_weights is not None:
        terms = terms * torch.where(mask, token_weights.detach(), 0.0).sum(dim=1) / tokens.clamp(min=1)
    terms = torch.where(in_loss, terms, 0.0)
    loss = terms.sum() / (normalizer if normalizer is not None else in_loss.sum().clamp(min=1))
    s = sequence_ratio.detach()[:, None].expand_as(mask)
    a = advantages[:, None].expand_as(mask)
    return loss, ratio_stats(torch.exp(log_ratio), log_ratio, mask,
                             (a < 0) & (s < 1.0 - eps_low), (a > 0) & (s > 1.0 + eps_high))


def cispo_loss(logprobs, old_logprobs, advantages, loss_mask, eps_low: float = 0.2, eps_high: float = 0.28,
               aggregation: str = "token-mean", normalizer: float | None = None, token_weights=None):
    """CISPO: -detach(clip(r, 1-eps_low, 1+eps_high)) * A * log pi per model token, aggregated as `aggregation` says.
    clip_low_frac / clip_high_frac: tokens (with a non-zero advantage) whose weight was clipped."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = loss_mask.bool()
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    token_terms = -weight * advantages * torch.where(mask, logprobs, 0.0)
    if token_weights is not None:
        token_terms = token_terms * token_weights.detach()
    token_terms = torch.where(mask, token_terms, 0.0)
    moving = advantages.expand_as(ratio) != 0
    return aggregate(token_terms, mask, aggregation, normalizer), ratio_stats(
        ratio, log_ratio, mask, moving & (ratio < 1.0 - eps_low), moving & (ratio > 1.0 + eps_high))


def objective_aggregation(cfg) -> str:
    """The aggregation the objective uses: GSPO's loss is a mean over sequences by definition."""
    return "sequence-mean" if cfg.objective == "gspo" else cfg.aggregation


def loss_denominator(loss_mask: torch.Tensor, aggregation: str, max_response_tokens: int) -> float:
    """A mini-batch's loss denominator, counting all its rows: its tokens in the loss (token-mean), its sequences
    that have any (sequence-mean), or the response budget times its sequences (token-sum)."""
    if aggregation == "token-sum":
        return float(max_response_tokens * loss_mask.shape[0])
    if aggregation == "token-mean":
        return max(float(loss_mask.sum()), 1.0)
    return max(float((loss_mask.sum(dim=1) > 0).sum()), 1.0)


def aggregate(token_terms: torch.Tensor, mask: torch.Tensor, aggregation: str, normalizer: float | None = None
              ) -> torch.Tensor:
    """The loss from per-token terms (zero off the mask); a given `normalizer` is the denominator (token-sum needs
    one), so the micro-batches of one mini-batch add up to the mini-batch's loss."""
    if aggregation == "token-sum":
        if normalizer is None:
            raise ValueError("token-sum needs normalizer = response budget x number of sequences")
        return token_terms.sum() / normalizer
    if aggregation == "token-mean":
        return token_terms.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    if aggregation == "sequence-mean":
        tokens_per_seq = mask.sum(dim=1)
        per_seq = token_terms.sum(dim=1) / tokens_per_seq.clamp(min=1)
        return per_seq.sum() / (normalizer if normalizer is not None else (tokens_per_seq > 0).sum().clamp(min=1))
    raise ValueError(f"unknown aggregation {aggregation!r}")


def objective_problems(cfg, objectives: tuple[str, ...]) -> list[str]:
    """What is wrong with the aggregation, objective and importance-sampling settings of a GRPOConfig or a
    retool Config, one line each; `objectives`: the names grpo.OBJECTIVES knows."""
    problems = []
    if cfg.aggregation not in AGGREGATIONS:
        problems.append(f"aggregation must be {', '.join(AGGREGATIONS[:-1])} or {AGGREGATIONS[-1]}, got '{cfg.aggregation}'")
    if cfg.objective not in objectives:
        problems.append(f"objective must be one of {', '.join(objectives)}, got '{cfg.objective}'")
    if cfg.tis_mode not in TIS_MODES:
        problems.append(f"tis_mode must be one of {', '.join(TIS_MODES)}, got '{cfg.tis_mode}'")
    elif cfg.tis_mode != "truncate" and not cfg.tis_cap > 1:
        problems.append(f"tis_mode {cfg.tis_mode} keeps ratios inside [1/tis_cap, tis_cap]: set tis_cap above 1 "
                        f"(2 is common), got {cfg.tis_cap}")
    if cfg.objective == "gspo":
        if max(cfg.eps_low, cfg.eps_high) > GSPO_WIDEST_EPS and not cfg.force_gspo_clip:
            problems.append(f"objective gspo clips a sequence's ratio, about 1000x tighter than PPO's: eps_low "
                            f"{cfg.eps_low} / eps_high {cfg.eps_high} are PPO-sized; use the paper's 3e-4 / 4e-4 "
                            "(--eps-low 3e-4 --eps-high 4e-4) or force them (--force-gspo-clip true)")
        if cfg.tis_cap and cfg.tis_mode != "sequence-mask":
            problems.append(f"objective gspo weighs whole sequences: with tis_cap, tis_mode must be sequence-mask, "
                            f"got '{cfg.tis_mode}'")
        if cfg.aggregation == "token-sum":
            problems.append("objective gspo averages over sequences: aggregation token-sum does not apply")
    return problems
