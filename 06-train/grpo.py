"""Chapter 06: the GRPO update, written by hand in torch; the story is docs/06-train.md.

    adv, n_degenerate = group_advantages(rewards, group_size)   # ±1 rewards -> advantages
    metrics = grpo_step(model, optimizer, trajectories, cfg)     # pi_old, clipped loss, backward, clip, AdamW
    sync_weights(model, llm)                                     # new weights into vLLM (weight_sync.py)

Key decisions: the advantage is the reward minus its group's mean (no std by default); only tokens the model
wrote carry gradient (`loss_mask`); pi_old is recomputed by the trainer, so the first mini-batch's ratio is exactly
1; clip-higher (0.2 below, 0.28 above); token-mean; no KL term; float32 master weights. PPO-clip with token-mean is
written out here; every other objective, aggregation and option is one call behind one `if` (objectives.py,
update_options.py), and what the ranks do alike under torchrun one call of `ranks` (distributed.py).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from distributed import RanksInStep, load_policy, unwrap  # load_policy re-exported: the trainer's model
from logprob_chunks import chunked_logprobs
from objectives import aggregate, cispo_loss, gspo_loss, loss_denominator, objective_aggregation, objective_problems
from update_metrics import UpdateTally, ratio_stats, sampler_mismatch
from update_options import make_adamw_state, set_gradient_checkpointing, tis_weights, first_minibatch_gives_pi_old, zero_gradients
from weight_sync import sleep_sampler, sync_weights  # re-exported: the loop takes the chapter's parts from here


@dataclass
class GRPOConfig:
    # optimisation
    lr: float = 1e-6
    weight_decay: float = 0.01  # at lr 1e-6 its pull is 1e-8 of a weight per step: negligible
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # clip the global gradient norm of each mini-batch
    # the clipped objective
    objective: str = "ppo-clip"  # "ppo-clip", "gspo" (a ratio per sequence: eps ~1000x narrower) or "cispo" (objectives.py)
    eps_low: float = 0.2  # the ratio may fall to 1 - eps_low (gspo: the paper's 3e-4)
    eps_high: float = 0.28  # and rise to 1 + eps_high (clip-higher; gspo: the paper's 4e-4)
    force_gspo_clip: bool = False  # let gspo run with a PPO-sized band (above 0.01), refused otherwise
    aggregation: str = "token-mean"  # or "sequence-mean", or "token-sum" (Dr. GRPO); gspo: always sequence-mean
    max_response_tokens: int = 0  # the response budget: token-sum divides by it times the sequences
    tis_cap: float = 0.0  # importance sampling of the sampler/trainer gap: the cap, or the band [1/cap, cap]; 0 = off
    tis_mode: str = "truncate"  # weight min(pi_old / pi_sampler, cap), or 0 outside the band: "token-mask", "sequence-mask"
    # batching: one step = num_minibatches optimizer updates over the trajectories
    num_minibatches: int = 2
    micro_batch_size: int = 8  # sequences per forward/backward: memory and speed only, never the update (torl-1.5b's)
    # numerics
    temperature: float = 1.0  # the sampler's temperature: logits are divided by it
    gradient_checkpointing: bool = False
    skip_zero_advantage: bool = True  # no forward/backward for rows without gradient; the update is the same


def group_advantages(rewards: list[float], group_size: int, scale: bool = False,
                     eps: float = 1e-6) -> tuple[list[float], int]:
    """Each reward minus its group's mean, for consecutive groups of `group_size` rewards; returns (advantages,
    n_degenerate). `scale=True` divides by the group's (unbiased) std plus `eps` (the original GRPO). A degenerate
    group (all rewards equal) gives zeros either way and is counted."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    degenerate = (r == r[:, :1]).all(dim=1)
    if scale and group_size > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    centred[degenerate] = 0.0  # exact zeros, not rounding noise
    return centred.flatten().tolist(), int(degenerate.sum())


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
                        aggregation: str = "token-mean", normalizer: float | None = None,
                        token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)` over model tokens; returns (loss, stats).
    Tensors are [B, T] (advantages may be [B]). Token-mean divides by the model tokens, or by `normalizer`, the whole
    mini-batch's count; any other `aggregation` is objectives.py's. `token_weights` ([B, T], no gradient) multiply
    each token's term: importance sampling."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = loss_mask.bool()
    # Masked positions are replaced, not multiplied by 0: no inf * 0 = NaN from padding.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    token_terms = -torch.minimum(ratio * advantages, clipped * advantages)
    if token_weights is not None:
        token_terms = token_terms * token_weights.detach()
    token_terms = torch.where(mask, token_terms, 0.0)
    if aggregation == "token-mean":
        loss = token_terms.sum() / (mask.sum().clamp(min=1) if normalizer is None else normalizer)
    else:
        loss = aggregate(token_terms, mask, aggregation, normalizer)  # objectives.py
    adv, r = advantages.expand_as(ratio), ratio.detach()
    return loss, ratio_stats(ratio, log_ratio, mask, (adv < 0) & (r < 1.0 - eps_low), (adv > 0) & (r > 1.0 + eps_high))


# The objective's name -> its loss; all take clipped_policy_loss's arguments (docs/06-beyond-torl.md).
OBJECTIVES = {"ppo-clip": clipped_policy_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def grpo_step(model, optimizer, trajectories, cfg: GRPOConfig, exclude=None, global_normalizer=None) -> dict[str, float]:
    """One GRPO step on trajectories that already carry `.advantage`; returns flat float metrics (docs/06-train.md).
    `exclude` (a bool per trajectory) keeps rows out of the loss and its denominator; `global_normalizer` makes a
    mini-batch's denominator the data-parallel one (distributed.py's `RanksInStep`)."""
    _check_step_inputs(trajectories, cfg, exclude)
    ranks = RanksInStep(model, global_normalizer)  # torchrun: this rank in step with the others (distributed.py)
    set_gradient_checkpointing(unwrap(model), cfg.gradient_checkpointing)
    model.train()  # Qwen2 has no dropout; train mode is what switches checkpointing on
    batch = build_batch(trajectories)
    if exclude is not None:  # rows that neither train nor count in the denominator (part 3's filters)
        batch = batch.keeping(~torch.tensor([bool(e) for e in exclude]))
    tally = UpdateTally(batch, exclude)  # the metrics' sums (update_metrics.py)
    # The rows the update runs: by default only those that add to the gradient, yet all count in the denominator.
    runs = batch.rows_with_gradient() if cfg.skip_zero_advantage else torch.ones(len(trajectories), dtype=torch.bool)
    tally.rows_skipped = int((~runs).sum())
    observed = batch.keeping(runs)  # what the metrics of pi_old describe: no forward runs for a metric alone
    # pi_old: the weights before any update. The first mini-batch's own forwards give it for their rows (the weights
    # have not moved yet); a pass of its own for the others' rows, or every row's when importance weights need it.
    own_forward = first_minibatch_gives_pi_old(cfg)
    old, entropy = _old_logprobs_and_entropy(model, batch, cfg, runs, ranks, skip_first=own_forward)
    token_weights = None
    if cfg.tis_cap > 0:  # importance weights for the sampler/trainer gap (part 3)
        token_weights, tis_metrics = tis_weights(old, observed, cfg.tis_cap, cfg.tis_mode)
        tally.step_metrics.update(tis_metrics)

    # PPO-clip with token-mean (clipped_policy_loss), unless the run chose another: objectives.py.
    objective, aggregation = OBJECTIVES[cfg.objective], objective_aggregation(cfg)
    for index, rows in enumerate(batch.minibatches(cfg.num_minibatches)):
        own = own_forward and index == 0  # this mini-batch's forwards are pi_old
        # the mini-batch's tokens in the loss, the skipped rows' included, so that skipping changes nothing
        normalizer = ranks.denominator(loss_denominator(batch.loss_mask[rows], aggregation, cfg.max_response_tokens))
        ranks.zero_grad(optimizer)
        passes = [(micro_rows, False) for micro_rows in _micro_batches(rows[runs[rows]], cfg.micro_batch_size)]
        # as many passes as the busiest rank: a filler (the shortest row, its loss times 0) joins the exchanges
        passes = ranks.pad(passes, (rows[-1:], True))
        for i, (micro_rows, filler) in enumerate(passes):
            micro = batch.select(micro_rows)
            with ranks.exchange(last=i == len(passes) - 1):  # DDP: one gradient exchange a mini-batch
                logprobs, micro_entropy = _target_logprobs(model, micro.input_ids, micro.attention_mask,
                                                           cfg.temperature, with_entropy=own)
            device, width = logprobs.device, logprobs.shape[1]
            if own:  # pi_old is this forward's own log-probs, detached
                old[micro_rows, :width], entropy[micro_rows, :width] = logprobs.detach().cpu(), micro_entropy.cpu()
            loss, stats = objective(
                logprobs, old[micro_rows, :width].to(device), micro.advantages.to(device), micro.loss_mask.to(device),
                cfg.eps_low, cfg.eps_high, aggregation, normalizer=normalizer,
                token_weights=None if token_weights is None else token_weights[micro_rows, :width].to(device))
            # ---- A KL penalty to a reference model would go here (ToRL's coefficient is 0): ----------------
            # loss = loss + kl_coef * k3(ref_logprobs - logprobs), ref_logprobs from a frozen copy of the initial model.
            (loss * 0.0 if filler else loss).backward()
            if not filler:
                tally.add_micro_batch(loss, stats)
        if not passes:  # every row skipped: AdamW still steps (momentum, weight decay), as it would unskipped
            zero_gradients(model)
        # Clip the gradient's norm, then step, unless the norm is NaN or inf: that would poison every weight it touches.
        grad_norm = ranks.whole_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        stepped = math.isfinite(grad_norm.item())
        if stepped:
            optimizer.step()
        tally.add_update(grad_norm.item(), stepped)
    ranks.zero_grad(optimizer)  # frees them before vLLM wakes
    return tally.metrics(sampler_mismatch(old, entropy, observed))


# --------------------------------------------------------------------------- the trainer's model and optimizer


def make_optimizer(model, cfg: GRPOConfig) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, which must be float32 (docs/06-train.md: "Precision")."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not_fp32 := {str(p.dtype) for p in params if p.dtype != torch.float32}:
        raise ValueError(f"trainer weights are {sorted(not_fp32)}: keep float32 master weights "
                         "(a 1e-6 step rounds away in bf16); load with load_policy or dtype=torch.float32")
    fused = params[0].device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)
    make_adamw_state(optimizer)  # its moments now, before vLLM takes its share, not inside the first update
    return optimizer


# --------------------------------------------------------------------------- the batch


@dataclass
class Batch:
    """Trajectories as right-padded tensors, aligned with what the model predicts.

    `input_ids` row = prompt_ids + token_ids, then padding. Every [B, T-1] tensor is in *target* coordinates:
    column j is about input_ids[:, j+1], the token predicted from input_ids[:, :j+1]. For prompt [p0, p1] and
    response [m0, o0, m1] (o0 an observation token):

        input_ids      p0  p1  m0  o0  m1
        targets            p1  m0  o0  m1
        loss_mask           0   1   0   1
        advantages          0   A   0   A
    """

    input_ids: torch.Tensor  # [B, T] long; padding is token 0 (never attended to, never scored)
    attention_mask: torch.Tensor  # [B, T] long; 1 on real tokens
    loss_mask: torch.Tensor  # [B, T-1] float; 1 where the target is a token the model wrote
    advantages: torch.Tensor  # [B, T-1] float; the trajectory's advantage where loss_mask is 1
    sampler_logprobs: torch.Tensor  # [B, T-1] float; vLLM's log-prob of the target where loss_mask is 1

    def select(self, rows: torch.Tensor) -> "Batch":
        """The given rows, with padding columns that none of them uses cut off."""
        width = int(self.attention_mask[rows].sum(dim=1).max())
        return Batch(self.input_ids[rows, :width], self.attention_mask[rows, :width],
                     *(t[rows, : width - 1] for t in (self.loss_mask, self.advantages, self.sampler_logprobs)))

    def keeping(self, rows: torch.Tensor) -> "Batch":
        """The batch with the other rows' loss mask and advantages zeroed (`rows`: one bool per row)."""
        kept = rows[:, None]
        return replace(self, loss_mask=self.loss_mask * kept, advantages=self.advantages * kept)

    def rows_with_gradient(self) -> torch.Tensor:
        """One bool per row: does it add to the gradient? Only with a token in the loss and a non-zero advantage."""
        return (self.advantages != 0).any(dim=1)

    def minibatches(self, n: int):
        """Row indices of `n` consecutive mini-batches (empty ones left out), each longest first so
        that its micro-batches pad to similar lengths; the gradient is a sum, the order is free."""
        lengths = self.attention_mask.sum(dim=1)
        for rows in torch.arange(len(lengths)).tensor_split(n):
            if len(rows):
                yield rows[torch.argsort(lengths[rows], descending=True, stable=True)]


def build_batch(trajectories) -> Batch:
    """Pad trajectories into a `Batch` (on CPU); see `Batch` for the alignment."""
    rows = len(trajectories)
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask = torch.zeros(rows, width - 1)
    advantages = torch.zeros(rows, width - 1)
    sampler_logprobs = torch.zeros(rows, width - 1)
    for i, t in enumerate(trajectories):
        if not (len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)):
            raise ValueError(f"trajectory {t.problem_id}/{t.group_index}: token_ids, loss_mask, logprobs differ in length")
        if t.advantage is None:
            raise ValueError(f"trajectory {t.problem_id}/{t.group_index} has no advantage")
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.problem_id}/{t.group_index} has an empty prompt")
        p, n = len(t.prompt_ids), len(t.token_ids)
        input_ids[i, : p + n] = torch.tensor(t.prompt_ids + t.token_ids)
        attention_mask[i, : p + n] = 1
        # response token k sits at input position p + k, i.e. target column p + k - 1
        m = torch.tensor(t.loss_mask, dtype=torch.float32)
        loss_mask[i, p - 1 : p - 1 + n] = m
        advantages[i, p - 1 : p - 1 + n] = m * t.advantage
        sampler_logprobs[i, p - 1 : p - 1 + n] = m * torch.tensor(t.logprobs, dtype=torch.float32)
    return Batch(input_ids, attention_mask, loss_mask, advantages, sampler_logprobs)


# --------------------------------------------------------------------------- log-probs


def token_logprobs(model, batch: Batch, temperature: float = 1.0, micro_batch_size: int | None = None) -> torch.Tensor:
    """[B, T-1] log-prob of every target of `batch` under `model`, on its device; padding's are noise, so mask with
    `batch.loss_mask`. With `micro_batch_size` the rows run in chunks; call it under `torch.no_grad()` then, or
    every chunk's graph is kept for backward."""
    rows = torch.arange(batch.input_ids.shape[0])
    width = batch.loss_mask.shape[1]
    pieces = []
    for chunk in rows.split(micro_batch_size or len(rows)):
        micro = batch.select(chunk)
        logprobs, _ = _target_logprobs(model, micro.input_ids, micro.attention_mask, temperature)
        pieces.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
    return torch.cat(pieces)


def _target_logprobs(model, input_ids, attention_mask, temperature: float, with_entropy: bool = False):
    """Log-probs [b, T-1] of the targets (and their entropy if asked) for one micro-batch."""
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:  # the final hidden states; the logits of one position only (logits_to_keep), never used
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1,
                       output_hidden_states=True).hidden_states[-1]
    # lm_head a chunk of positions at a time: the whole [b, T, vocabulary] would cap the micro-batch
    return chunked_logprobs(hidden, unwrap(model).lm_head, input_ids[:, 1:], temperature, with_entropy)


def _micro_batches(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`rows` in consecutive chunks of `size`; none when there are no rows."""
    return [chunk for chunk in rows.split(size) if len(chunk)]


@torch.no_grad()
def _old_logprobs_and_entropy(model, batch: Batch, cfg: GRPOConfig, runs: torch.Tensor, ranks: RanksInStep,
                              skip_first: bool = False):
    """Log-probs and entropies of the targets of the rows the update `runs`, under the current weights, on CPU
    (zeros elsewhere, and in the first mini-batch's rows if `skip_first`: its own forwards fill them). In the
    update's own micro-batches: the same shapes give the same bits."""
    old, entropy = torch.zeros(batch.loss_mask.shape), torch.zeros(batch.loss_mask.shape)
    minibatches = list(batch.minibatches(cfg.num_minibatches))[1 if skip_first else 0:]
    chunks = [micro for rows in minibatches for micro in _micro_batches(rows[runs[rows]], cfg.micro_batch_size)]
    # FSDP2 gathers weights in every forward: as many as the other ranks, the extra ones on the shortest row
    chunks = ranks.pad(chunks, next(batch.minibatches(1))[-1:], at_least=0)
    for chunk in chunks:
        micro = batch.select(chunk)
        lp, ent = _target_logprobs(model, micro.input_ids, micro.attention_mask, cfg.temperature, with_entropy=True)
        old[chunk, : lp.shape[1]] = lp.float().cpu()
        entropy[chunk, : lp.shape[1]] = ent.float().cpu()
    return old, entropy


# --------------------------------------------------------------------------- checks


def _check_step_inputs(trajectories, cfg: GRPOConfig, exclude) -> None:
    if not trajectories:
        raise ValueError("grpo_step needs at least one trajectory")
    if problems := objective_problems(cfg, tuple(OBJECTIVES)):  # settings that would train something else
        raise ValueError(problems[0])
    if cfg.aggregation == "token-sum" and cfg.max_response_tokens < 1:
        raise ValueError("aggregation token-sum divides by the response budget: set GRPOConfig.max_response_tokens")
    if exclude is not None and len(exclude) != len(trajectories):
        raise ValueError(f"exclude has {len(exclude)} entries for {len(trajectories)} trajectories")


if __name__ == "__main__":  # the advantage examples, printed
    import argparse

    from lab_cli import one_line_errors

    parser = argparse.ArgumentParser(description="Chapter 06's update (imported by 05-retool/retool.py). Run alone, it "
                                     "prints the group advantages of four example groups of rewards, plain and std-scaled.")
    one_line_errors(parser).parse_args()
    for rewards in ([1, -1, -1, -1], [1, 1, 1, -1], [-1, -1, -1, -1], [1, 1, -1, -1]):
        print(rewards, "->", group_advantages(rewards, 4), "scaled:", group_advantages(rewards, 4, scale=True)[0])
