"""Chapter 06: the GRPO update, written by hand in torch. The story: docs/06-train.md.

    adv, n_degenerate = group_advantages(rewards, group_size)   # ±1 rewards -> advantages
    metrics = grpo_step(model, optimizer, trajectories, cfg)     # old log-probs, clipped loss, AdamW
    sync_weights(model, llm)                                     # new weights into vLLM (weight_sync.py)

Key decisions: the advantage is the reward minus its group's mean (no std);
only tokens the model wrote carry gradient (`loss_mask`); pi_old is recomputed
by the trainer, so the first mini-batch's ratio is exactly 1 and the gap to
vLLM's log-probs is logged as a mismatch; clip-higher (0.2 below, 0.28 above);
token-mean aggregation; no KL term; float32 master weights.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from distributed import full_tensor, gradient_sync, is_data_parallel, unwrap
from weight_sync import sleep_sampler, sync_weights  # re-exported: the loop takes the chapter's parts from here


@dataclass
class GRPOConfig:
    # optimisation
    lr: float = 1e-6
    weight_decay: float = 0.01  # at lr 1e-6 its pull is 1e-8 of a weight per step: negligible
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # clip the global gradient norm of each mini-batch
    # the clipped objective
    eps_low: float = 0.2  # the ratio may fall to 1 - eps_low
    eps_high: float = 0.28  # and rise to 1 + eps_high (clip-higher)
    aggregation: str = "token-mean"  # or "sequence-mean", or "token-sum" (Dr. GRPO)
    max_response_tokens: int = 0  # the response budget: token-sum divides by it times the sequences
    tis_cap: float = 0.0  # truncated importance sampling: weight min(pi_old / pi_sampler, tis_cap); 0 = off
    # batching: one step = num_minibatches optimizer updates over the trajectories
    num_minibatches: int = 2
    micro_batch_size: int = 4  # sequences per forward/backward; gradients accumulate across them
    # numerics
    temperature: float = 1.0  # the sampler's temperature: logits are divided by it
    gradient_checkpointing: bool = False
    skip_zero_advantage: bool = True  # no forward/backward for rows without gradient; the update is the same


AGGREGATIONS = ("token-mean", "sequence-mean", "token-sum")


# --------------------------------------------------------------------------- main line


def group_advantages(
    rewards: list[float], group_size: int, scale: bool = False, eps: float = 1e-6
) -> tuple[list[float], int]:
    """Advantages for consecutive groups of `group_size` rewards; returns (advantages, n_degenerate).

    Rewards come group by group: the first `group_size` answer one problem, the
    next `group_size` the next problem, and so on. Each reward minus its group's
    mean says how much better than its siblings an answer was:

        rewards [+1, -1, -1, -1]  ->  [+1.5, -0.5, -0.5, -0.5]   one right answer in four
        rewards [+1, +1, +1, -1]  ->  [+0.5, +0.5, +0.5, -1.5]   one wrong answer in four
        rewards [-1, -1, -1, -1]  ->  [0, 0, 0, 0]               degenerate: nothing to compare

    With `scale=True` each centred value is divided by the group's (unbiased)
    standard deviation plus `eps`: [+1, -1, -1, -1] has std 1, so it stays
    [+1.5, -0.5, -0.5, -0.5]; [+1, +1, -1, -1] has std 1.155 and becomes
    [+0.866, +0.866, -0.866, -0.866] instead of [+1, +1, -1, -1].
    A degenerate group (all rewards equal) gives zeros either way and is counted.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    degenerate = (r == r[:, :1]).all(dim=1)
    if scale and group_size > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    centred[degenerate] = 0.0  # exact zeros, not rounding noise
    return centred.flatten().tolist(), int(degenerate.sum())


def grpo_step(model, optimizer, trajectories, cfg: GRPOConfig, exclude=None, global_normalizer=None) -> dict[str, float]:
    """One GRPO step on trajectories that already carry `.advantage`; returns flat metrics.

    1. Old log-probs and entropy of every model token, with the current weights, no gradient.
    2. The sampler/trainer mismatch: vLLM's recorded log-probs against those old log-probs
       (and, with `cfg.tis_cap`, each token's truncated importance weight from the same gap).
    3. `cfg.num_minibatches` optimizer updates; each accumulates gradients over
       micro-batches of `cfg.micro_batch_size` sequences, clips the gradient norm
       to `cfg.max_grad_norm`, and steps AdamW. The first mini-batch sees ratio 1
       exactly (old and new weights are the same); later ones see how far the
       earlier updates moved the policy, and the clip limits that.

    `exclude`, one bool per trajectory, keeps those out of the loss: their
    tokens get no gradient and do not count in the denominator (DAPO's overlong
    filtering, SimpleTIR's void-turn filter); the mismatch and entropy still cover them.

    Metrics (all floats, token-weighted over the whole step unless said otherwise):
    loss and grad_norm (means over mini-batches; grad_norm before clipping),
    clip_low_frac / clip_high_frac (share of trained tokens whose gradient the clip
    removed, on each side), ratio_mean, ratio_max, approx_kl (old -> new, k3
    estimator, over the rows the update ran on), entropy (of the policy before
    the step), mismatch_abs, mismatch_max, mismatch_kl (sampler -> trainer),
    tokens (in the loss), informative_frac (share of those tokens whose advantage
    is not zero), sequences, excluded_sequences, rows_skipped (zero
    advantage: no forward or backward), optimizer_steps, skipped_steps
    (non-finite gradient norm: no update); with tis_cap, tis_weight_mean and
    tis_capped_frac over trained tokens.

    Trajectories with zero advantage (degenerate groups) add no gradient but do
    count in the denominator, as if they had run: skipping them changes no weight.

    Data parallel (`model` wrapped in DDP or sharded by FSDP2, see distributed.py):
    `global_normalizer` maps this process's mini-batch denominator to the one it
    must divide by so that the averaged gradient is the whole batch's; metrics
    stay this process's own. There zero-advantage rows are not skipped: every rank
    runs the same backward passes, whose collectives exchange the gradients.
    """
    _check_step_inputs(trajectories, cfg, exclude)
    batch = build_batch(trajectories)
    _set_gradient_checkpointing(model, cfg.gradient_checkpointing)
    model.train()  # Qwen2 has no dropout; train mode is what switches checkpointing on

    # 1. pi_old: the weights as they are now, before any update of this step.
    old_logprobs, entropy = _old_logprobs_and_entropy(model, batch, cfg)
    mask = batch.loss_mask.bool()

    # 2. How far the sampler's numbers are from the trainer's for the same weights.
    gap = torch.where(mask, old_logprobs - batch.sampler_logprobs, 0.0)
    metrics = {
        "entropy": _masked_mean(entropy, mask),
        "mismatch_abs": _masked_mean(gap.abs(), mask),
        "mismatch_max": float(gap.abs().max()),
        "mismatch_kl": _masked_mean(torch.expm1(gap) - gap, mask),  # k3 of KL(sampler || trainer)
        "sequences": float(len(trajectories)),
    }
    if exclude is not None and any(exclude):
        kept = ~torch.tensor([bool(e) for e in exclude])[:, None]
        batch = replace(batch, loss_mask=batch.loss_mask * kept, advantages=batch.advantages * kept)
        mask = batch.loss_mask.bool()
    metrics["excluded_sequences"] = float(sum(bool(e) for e in exclude or ()))
    n_tokens = int(mask.sum())
    metrics["tokens"] = float(n_tokens)
    tis_weights = None
    if cfg.tis_cap > 0:
        # pi_old / pi_sampler per token, capped: the sample came from the sampler, the
        # gradient is for the trainer's policy. A weight, never differentiated.
        trainer_over_sampler = torch.exp(gap)
        tis_weights = torch.where(mask, trainer_over_sampler.clamp(max=cfg.tis_cap), 0.0)
        metrics["tis_weight_mean"] = _masked_mean(tis_weights, mask)
        metrics["tis_capped_frac"] = _masked_mean(trainer_over_sampler > cfg.tis_cap, mask)

    # 3. Updates. Within a mini-batch, rows are sorted by length so each
    # micro-batch pads to similar lengths; the gradient is a sum, order is free.
    totals = {"loss": 0.0, "grad_norm": 0.0, "ratio_max": 0.0, "seen": 0.0}  # seen: tokens the update ran on
    token_sums = dict.fromkeys(("clip_low_frac", "clip_high_frac", "ratio_mean", "approx_kl"), 0.0)
    updates = skipped_updates = rows_skipped = 0
    lengths = batch.attention_mask.sum(dim=1)
    row_advantage = torch.tensor([float(t.advantage) for t in trajectories])
    has_gradient = (row_advantage != 0) & mask.any(dim=1)
    # Token-mean divides by every trained token, informative or not: this share is
    # the factor by which zero-advantage rows shrink the step (docs/06, exercise 2).
    metrics["informative_frac"] = float(mask[has_gradient].sum()) / max(n_tokens, 1)
    # Under DDP or FSDP2 every rank must run the same backward passes (they exchange
    # gradients in them): a rank that skipped rows would leave the others waiting.
    skip_rows = cfg.skip_zero_advantage and not is_data_parallel(model)
    for rows in torch.arange(len(trajectories)).tensor_split(cfg.num_minibatches):
        if len(rows) == 0:
            continue
        rows = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
        # The denominator counts every row of the mini-batch, including those skipped below.
        normalizer = _normalizer(batch.loss_mask[rows], cfg.aggregation, cfg.max_response_tokens)
        if global_normalizer is not None:
            normalizer = global_normalizer(normalizer)
        if skip_rows:
            rows_skipped += int((~has_gradient[rows]).sum())
            rows = rows[has_gradient[rows]]
        optimizer.zero_grad(set_to_none=True)
        micro_batches = rows.split(cfg.micro_batch_size) if len(rows) else ()
        for micro_rows in micro_batches:
            micro = batch.select(micro_rows)
            width = micro.loss_mask.shape[1]
            old = old_logprobs[micro_rows, :width]
            weights = None if tis_weights is None else tis_weights[micro_rows, :width]
            logprobs, _ = _target_logprobs(model, micro.input_ids, micro.attention_mask, cfg.temperature)
            device = logprobs.device
            loss, stats = clipped_policy_loss(
                logprobs, old.to(device), micro.advantages.to(device),
                micro.loss_mask.to(device), cfg.eps_low, cfg.eps_high,
                cfg.aggregation, normalizer=normalizer,
                token_weights=None if weights is None else weights.to(device),
            )
            # ---- A KL penalty to a reference model would go here. ----------------
            # loss = loss + kl_coef * k3(ref_logprobs - logprobs) over model tokens,
            # with ref_logprobs from a frozen copy of the initial model, computed in
            # step 1 beside old_logprobs. ToRL uses kl_coef = 0, so the lab keeps
            # neither the copy nor its memory.
            with gradient_sync(model, micro_rows is micro_batches[-1]):
                loss.backward()
            totals["loss"] += float(loss.detach())
            totals["seen"] += stats["tokens"]
            for key in token_sums:
                token_sums[key] += stats[key] * stats["tokens"]
            totals["ratio_max"] = max(totals["ratio_max"], stats["ratio_max"])
        if len(rows) == 0:
            # Every row was skipped. Unskipped, backward would have left zero gradients
            # and AdamW would still step (momentum, weight decay): give it those zeros.
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)).item()
        if math.isfinite(grad_norm):
            optimizer.step()
            totals["grad_norm"] += grad_norm
            updates += 1
        else:  # a NaN/inf gradient would poison every weight it touches: drop this update
            skipped_updates += 1
        optimizer.zero_grad(set_to_none=True)

    per_token = max(n_tokens, 1)
    seen = max(totals["seen"], 1.0)
    n_minibatches = max(updates + skipped_updates, 1)
    metrics.update({
        "loss": totals["loss"] / n_minibatches,
        "grad_norm": totals["grad_norm"] / max(updates, 1),
        "clip_low_frac": token_sums["clip_low_frac"] / per_token,  # zero-advantage tokens are never clipped
        "clip_high_frac": token_sums["clip_high_frac"] / per_token,
        "ratio_mean": token_sums["ratio_mean"] / seen if totals["seen"] else 1.0,
        "ratio_max": totals["ratio_max"] if totals["seen"] else 1.0,
        "approx_kl": token_sums["approx_kl"] / seen,
        "rows_skipped": float(rows_skipped),
        "optimizer_steps": float(updates),
        "skipped_steps": float(skipped_updates),
    })
    return metrics


def make_optimizer(model, cfg: GRPOConfig) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, which must be float32 (docs/06: "Precision")."""
    params = [p for p in model.parameters() if p.requires_grad]
    not_fp32 = {str(p.dtype) for p in params if p.dtype != torch.float32}
    if not_fp32:
        raise ValueError(
            f"trainer weights are {sorted(not_fp32)}: keep float32 master weights "
            "(a 1e-6 step rounds away in bf16); load with load_policy or dtype=torch.float32"
        )
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)


def load_policy(model_path, device: str | torch.device | None = None):
    """The trainer's copy of the model: float32 weights on `device` (CUDA if there is one)."""
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.to(device)


# --------------------------------------------------------------------------- the batch


@dataclass
class Batch:
    """Trajectories as right-padded tensors, aligned with what the model predicts.

    `input_ids` row = prompt_ids + token_ids, then padding. Every [B, T-1]
    tensor is in *target* coordinates: column j is about input_ids[:, j+1], the
    token predicted from input_ids[:, :j+1]. For prompt [p0, p1] and response
    [m0, o0, m1] (o0 an observation token):

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
        return Batch(
            self.input_ids[rows, :width],
            self.attention_mask[rows, :width],
            self.loss_mask[rows, : width - 1],
            self.advantages[rows, : width - 1],
            self.sampler_logprobs[rows, : width - 1],
        )


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


# --------------------------------------------------------------------------- the loss


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)` over model tokens; returns (loss, stats).

    All tensors are [B, T] (advantages may be [B], one per sequence).
    "token-mean": sum over model tokens / number of model tokens.
    "sequence-mean": each sequence's mean over its model tokens, then the mean
    over sequences that have any. "token-sum" (Dr. GRPO): the sum over model
    tokens divided by `normalizer`, which it requires: the response budget times
    the number of sequences, one constant whatever the lengths. Otherwise
    `normalizer` replaces the denominator (tokens or sequences) so micro-batches
    of one mini-batch add up to the mini-batch's loss. `token_weights` ([B, T],
    no gradient) multiply each token's term: truncated importance sampling.

    Where the clip is active the gradient is zero: with A > 0 once r > 1 + eps_high
    (already raised enough), with A < 0 once r < 1 - eps_low (already lowered
    enough). Example, A = +1: r = 1.5 gives -min(1.5, 1.28) = -1.28 and no
    gradient; r = 0.5 gives -min(0.5, 0.8) = -0.5 with gradient (a token made
    less likely against its advantage is always pulled back).
    stats: clip_low_frac, clip_high_frac (share of model tokens clipped on each
    side), ratio_mean, ratio_max, approx_kl (k3 estimate of KL(old || new)), tokens.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    mask = loss_mask.bool()
    # Masked positions are replaced, not multiplied by 0: no inf * 0 = NaN from padding.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    per_token = torch.where(mask, per_token, 0.0)

    if aggregation == "token-sum":
        if normalizer is None:
            raise ValueError("token-sum needs normalizer = response budget x number of sequences")
        loss = per_token.sum() / normalizer
    elif aggregation == "token-mean":
        denominator = normalizer if normalizer is not None else mask.sum().clamp(min=1)
        loss = per_token.sum() / denominator
    elif aggregation == "sequence-mean":
        tokens_per_seq = mask.sum(dim=1)
        per_seq = per_token.sum(dim=1) / tokens_per_seq.clamp(min=1)
        denominator = normalizer if normalizer is not None else (tokens_per_seq > 0).sum().clamp(min=1)
        loss = per_seq.sum() / denominator
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")

    with torch.no_grad():
        adv = advantages.expand_as(ratio)
        r = ratio.detach()
        stats = {
            "clip_low_frac": _masked_mean((adv < 0) & (r < 1.0 - eps_low), mask),
            "clip_high_frac": _masked_mean((adv > 0) & (r > 1.0 + eps_high), mask),
            "ratio_mean": _masked_mean(r, mask),
            "ratio_max": float(r[mask].max()) if mask.any() else 1.0,
            "approx_kl": _masked_mean((r - 1.0) - log_ratio.detach(), mask),
            "tokens": float(mask.sum()),
        }
    return loss, stats


# --------------------------------------------------------------------------- helpers


def token_logprobs(model, batch: Batch, temperature: float = 1.0, micro_batch_size: int | None = None) -> torch.Tensor:
    """[B, T-1] log-prob of every target token of `batch` under `model`, logits divided by `temperature`.

    Positions whose target is padding hold whatever the model says about token
    0 there; multiply by `batch.loss_mask` (or index with it) before use. With
    `micro_batch_size` the rows run in chunks, so only one chunk's logits exist
    in float32 at a time; call it under `torch.no_grad()` then, or every chunk's
    graph is kept for backward. The result is on the model's device.
    """
    rows = torch.arange(batch.input_ids.shape[0])
    width = batch.loss_mask.shape[1]
    pieces = []
    for chunk in rows.split(micro_batch_size or len(rows)):
        micro = batch.select(chunk)
        logprobs, _ = _target_logprobs(model, micro.input_ids, micro.attention_mask, temperature)
        pieces.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
    return torch.cat(pieces)


def _check_step_inputs(trajectories, cfg: GRPOConfig, exclude) -> None:
    if not trajectories:
        raise ValueError("grpo_step needs at least one trajectory")
    if cfg.aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {cfg.aggregation!r} (choose from {', '.join(AGGREGATIONS)})")
    if cfg.aggregation == "token-sum" and cfg.max_response_tokens < 1:
        raise ValueError("aggregation token-sum divides by the response budget: set GRPOConfig.max_response_tokens")
    if exclude is not None and len(exclude) != len(trajectories):
        raise ValueError(f"exclude has {len(exclude)} entries for {len(trajectories)} trajectories")


def _target_logprobs(model, input_ids, attention_mask, temperature: float, with_entropy: bool = False):
    """Log-probs [b, T-1] of the targets (and their entropy if asked) for one micro-batch."""
    device = _device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()  # the last position predicts past the end
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    # logit[target] - logsumexp keeps only the logits for backward, not a log_softmax copy
    log_norm = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets).squeeze(-1) - log_norm
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy


@torch.no_grad()
def _old_logprobs_and_entropy(model, batch: Batch, cfg: GRPOConfig):
    """Log-probs and entropies of all targets under the current weights, on CPU, in micro-batches."""
    old = torch.zeros(batch.loss_mask.shape)
    entropy = torch.zeros(batch.loss_mask.shape)
    lengths = batch.attention_mask.sum(dim=1)
    rows = torch.argsort(lengths, descending=True, stable=True)
    for chunk in rows.split(cfg.micro_batch_size):
        micro = batch.select(chunk)
        lp, ent = _target_logprobs(model, micro.input_ids, micro.attention_mask, cfg.temperature, with_entropy=True)
        old[chunk, : lp.shape[1]] = lp.float().cpu()
        entropy[chunk, : lp.shape[1]] = ent.float().cpu()
    return old, entropy


def _normalizer(loss_mask: torch.Tensor, aggregation: str, max_response_tokens: int = 0) -> float:
    """The mini-batch's denominator: its model tokens (token-mean), its sequences that have
    any (sequence-mean), or the response budget times its sequences (token-sum)."""
    if aggregation == "token-sum":
        return float(max_response_tokens * loss_mask.shape[0])
    if aggregation == "token-mean":
        return max(float(loss_mask.sum()), 1.0)
    return max(float((loss_mask.sum(dim=1) > 0).sum()), 1.0)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, values.float(), 0.0).sum() / n) if n else 0.0


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _set_gradient_checkpointing(model, on: bool) -> None:
    model = unwrap(model)
    if on and not model.is_gradient_checkpointing:
        # non-reentrant: works when the inputs (token ids) need no gradient
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif not on and model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


__all__ = [
    "GRPOConfig", "Batch", "group_advantages", "grpo_step", "sync_weights", "sleep_sampler",
    "make_optimizer", "load_policy", "build_batch", "token_logprobs", "clipped_policy_loss",
]

if __name__ == "__main__":  # the advantage examples, printed
    for rewards in ([1, -1, -1, -1], [1, 1, 1, -1], [-1, -1, -1, -1], [1, 1, -1, -1]):
        print(rewards, "->", group_advantages(rewards, 4), "scaled:", group_advantages(rewards, 4, scale=True)[0])
