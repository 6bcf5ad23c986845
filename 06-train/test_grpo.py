"""The GRPO update's contract, one rule per test (tiny model, CPU, float32)."""
import copy
import math
import re

import pytest
import torch

import grpo
from grpo import (
    GRPOConfig,
    build_batch,
    clipped_policy_loss,
    group_advantages,
    grpo_step,
    load_policy,
    make_optimizer,
    sleep_sampler,
    sync_weights,
    token_logprobs,
)
from rollout import Trajectory

# Trainer and sampler both run float32 here; they agree to about 1e-6.
LOGPROB_TOL = 1e-4


@pytest.fixture
def policy(tiny_model_path):
    """A fresh float32 trainer copy of the tiny model for each test."""
    torch.manual_seed(0)
    return load_policy(tiny_model_path, device="cpu")


def make_trajectory(prompt, tokens, mask=None, advantage=1.0, logprobs=None):
    mask = mask if mask is not None else [1] * len(tokens)
    logprobs = logprobs if logprobs is not None else [0.0] * len(tokens)
    return Trajectory("p", 0, "", list(prompt), list(tokens), list(logprobs), list(mask), "", advantage=advantage)


def random_trajectories(n=5, seed=0):
    """Trajectories of different lengths, with an observation span inside each, mixed advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 400, (4 + i,), generator=g).tolist()
        tokens = torch.randint(3, 400, (10 + 3 * i,), generator=g).tolist()
        mask = [1] * len(tokens)
        mask[3:6] = [0, 0, 0]  # three interpreter-output tokens
        out.append(make_trajectory(prompt, tokens, mask, advantage=[1.5, -0.5, 0.5, -1.5, 1.0][i % 5]))
    return out


def summed_logprob(model, trajectory):
    batch = build_batch([trajectory])
    with torch.no_grad():
        return float((token_logprobs(model, batch) * batch.loss_mask).sum())


# --------------------------------------------------------------------------- advantages


def test_advantage_is_reward_minus_group_mean():
    adv, degenerate = group_advantages([1, -1, -1, -1, 1, 1, 1, -1], group_size=4)
    assert adv == [1.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5, -1.5]
    assert degenerate == 0


def test_scaled_advantage_divides_by_the_group_standard_deviation():
    adv, _ = group_advantages([1, 1, -1, -1], group_size=4, scale=True)
    std = math.sqrt(4 / 3)  # unbiased: sum of squares 4 over n - 1 = 3
    assert adv == pytest.approx([1 / std, 1 / std, -1 / std, -1 / std], abs=1e-5)


def test_group_with_equal_rewards_gives_zeros_and_is_counted_degenerate():
    for scale in (False, True):
        adv, degenerate = group_advantages([1, 1, 1, 1, -1, -1, -1, -1, 1, -1, -1, -1], 4, scale=scale)
        assert adv[:8] == [0.0] * 8
        assert degenerate == 2


def test_rewards_must_fill_whole_groups():
    with pytest.raises(ValueError):
        group_advantages([1, -1, 1], group_size=2)


# --------------------------------------------------------------------------- batch alignment


def test_loss_mask_lines_up_with_the_token_it_scores():
    # prompt [10, 11]; response: model 20, observation 21, model 22
    t = make_trajectory([10, 11], [20, 21, 22], mask=[1, 0, 1], advantage=2.0, logprobs=[-1.0, 0.0, -3.0])
    short = make_trajectory([10], [30], advantage=-1.0, logprobs=[-0.5])
    batch = build_batch([t, short])
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 22], [10, 30, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # column j scores input_ids[:, j + 1]
    assert batch.loss_mask.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 2, 0, 2], [-1, 0, 0, 0]]
    assert batch.sampler_logprobs.tolist() == [[0, -1, 0, -3], [-0.5, 0, 0, 0]]


def test_trajectory_without_advantage_is_refused():
    with pytest.raises(ValueError, match="no advantage"):
        build_batch([make_trajectory([1], [2], advantage=None)])


# --------------------------------------------------------------------------- the loss


def hand_case():
    """Two sequences; ratios chosen so both clips are active.

    seq 0, A = +1: r = 1.5 (clipped high: -1.28), r = 0.5 (-0.5), then padding
    seq 1, A = -1: r = 1.1 (+1.1), r = 0.7 (clipped low: +0.8), r = 1.6 (+1.6: a
                   token made likelier against its negative advantage is never clipped)
    """
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.1, 0.7, 1.6]])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]])
    logprobs = (old + ratios.log()).requires_grad_()
    with torch.no_grad():
        logprobs[0, 2] = 100.0  # padding: must not matter, even where exp overflows
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([1.0, -1.0])
    return logprobs, old, advantages, mask


def test_token_mean_loss_equals_hand_computation_with_both_clips_active():
    logprobs, old, adv, mask = hand_case()
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "token-mean")
    assert float(loss.detach()) == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8 + 1.6) / 5, abs=1e-6)
    assert stats["clip_high_frac"] == pytest.approx(1 / 5)
    assert stats["clip_low_frac"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7 + 1.6) / 5, abs=1e-6)
    assert stats["ratio_max"] == pytest.approx(1.6, abs=1e-6)
    assert stats["tokens"] == 5


def test_sequence_mean_loss_equals_hand_computation_with_both_clips_active():
    logprobs, old, adv, mask = hand_case()
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "sequence-mean")
    seq0 = (-1.28 - 0.5) / 2
    seq1 = (1.1 + 0.8 + 1.6) / 3
    assert float(loss.detach()) == pytest.approx((seq0 + seq1) / 2, abs=1e-6)
    assert stats["clip_high_frac"] == pytest.approx(1 / 5)
    assert stats["clip_low_frac"] == pytest.approx(1 / 5)


def test_clipped_tokens_and_padding_get_no_gradient_the_others_do():
    logprobs, old, adv, mask = hand_case()
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "token-mean")
    loss.backward()
    g = logprobs.grad
    assert torch.isfinite(g).all()
    # clipped high (1.5, A>0), padding, clipped low (0.7, A<0): exactly zero
    assert g[0, 0] == 0 and g[0, 2] == 0 and g[1, 1] == 0
    # d/dlogprob of -r*A/5 is -r*A/5
    assert float(g[0, 1]) == pytest.approx(-0.5 / 5, abs=1e-6)
    assert float(g[1, 0]) == pytest.approx(1.1 / 5, abs=1e-6)
    assert float(g[1, 2]) == pytest.approx(1.6 / 5, abs=1e-6)


def test_sequence_mean_weighs_each_trajectory_the_same():
    # one short and one long sequence, same advantage: token-mean gives every
    # token weight 1/total, sequence-mean gives each sequence's tokens 1/(2*len)
    logprobs = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    for aggregation, short, long in (("token-mean", 1 / 5, 1 / 5), ("sequence-mean", 1 / 2, 1 / 8)):
        logprobs.grad = None
        loss, _ = clipped_policy_loss(logprobs, torch.zeros(2, 4), torch.tensor([1.0, 1.0]), mask, aggregation=aggregation)
        loss.backward()
        assert float(-logprobs.grad[0, 0]) == pytest.approx(short)
        assert float(-logprobs.grad[1, 0]) == pytest.approx(long)


# --------------------------------------------------------------------------- the model


def test_gradient_is_zero_at_prompt_observation_and_padding_positions(policy):
    captured = {}

    def keep_hidden(module, inputs, output):  # the final hidden states, which lm_head turns into logits chunk by chunk
        output.last_hidden_state.retain_grad()
        captured["hidden"] = output.last_hidden_state

    policy.model.register_forward_hook(keep_hidden)
    trajectories = random_trajectories(3)
    batch = build_batch(trajectories)
    logprobs = token_logprobs(policy, batch)
    loss, _ = clipped_policy_loss(logprobs, logprobs.detach(), batch.advantages, batch.loss_mask)
    loss.backward()

    grad = captured["hidden"].grad  # [B, T, hidden]; position j predicts input j + 1
    scored = torch.zeros(grad.shape[:2], dtype=torch.bool)
    scored[:, :-1] = batch.loss_mask.bool()
    assert (grad[~scored] == 0).all()
    assert (grad[scored].abs().sum(-1) > 0).all()
    # the mask really held all three kinds of unscored position
    assert (batch.attention_mask == 0).any()
    assert not scored[0, : len(trajectories[0].prompt_ids) - 1].any()


def test_temperature_divides_the_logits(policy):
    batch = build_batch(random_trajectories(2))
    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        got = token_logprobs(policy, batch, temperature=0.7, micro_batch_size=1)
    m = batch.loss_mask.bool()
    assert torch.allclose(got[m], expected[m], atol=1e-5)


def whole_logprobs_and_entropy(logits, targets, temperature):
    """The log-probs and entropy with every position at once: the form the chunks must equal."""
    logits = logits[:, :-1].float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm, entropy.detach()


def test_log_probs_entropy_and_gradients_in_chunks_are_the_whole_forms_bit_for_bit(policy, monkeypatch):
    """lm_head on each chunk of positions, recomputed in backward, against the plain form: the model's whole [B, T, V]
    logits, then log_softmax. The same log-probs, entropy and gradients to the bit on the CPU, except the output
    layer's: a sum over positions, added chunk by chunk, equal to float32 rounding."""
    import logprob_chunks

    monkeypatch.setattr(logprob_chunks, "CHUNK_TOKENS", 8)  # 2 positions a chunk for 4 rows: many chunks, a ragged last
    batch = build_batch(random_trajectories(4))
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.loss_mask
    targets = batch.input_ids[:, 1:]
    results = []
    for chunked in (True, False):
        model = copy.deepcopy(policy)
        if chunked:  # what grpo_step runs
            logprobs, entropy = grpo._target_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, with_entropy=True)
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            logprobs, entropy = whole_logprobs_and_entropy(logits, targets, 0.7)
        (logprobs * weights).sum().backward()
        results.append({"logprobs": logprobs.detach(), "entropy": entropy,
                        **{name: p.grad for name, p in model.named_parameters()}})
    chunked, whole = results
    output_layer = next(name for name, p in policy.named_parameters() if p is policy.lm_head.weight)
    assert chunked.keys() == whole.keys() and len(chunked) == 2 + len(list(policy.parameters()))
    for name in chunked:
        if name == output_layer:
            torch.testing.assert_close(chunked[name], whole[name], rtol=1e-6, atol=1e-5)
            assert not torch.equal(chunked[name], torch.zeros_like(chunked[name]))
        else:
            assert torch.equal(chunked[name], whole[name]), name
    assert any(chunked[name].abs().sum() > 0 for name in chunked if name.startswith("model.layers"))


def log_prob_memory(chunk_tokens, rows=2, positions=1025, vocabulary=4096, hidden_size=64):
    """Peak bytes alive and the largest float32 tensor while bf16 hidden states go through an output layer and
    chunked_logprobs, forward and backward (as a GPU's autocast makes them); and the logits' value count."""
    import weakref

    import logprob_chunks
    from torch.utils._python_dispatch import TorchDispatchMode

    live, seen = {}, {"now": 0, "peak": 0, "float32": 0}

    def freed(pointer):
        seen["now"] -= live.pop(pointer, 0)

    class Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in live:
                    storage = t.untyped_storage()
                    live[storage.data_ptr()] = storage.nbytes()
                    seen["now"] += storage.nbytes()
                    seen["peak"] = max(seen["peak"], seen["now"])
                    weakref.finalize(storage, freed, storage.data_ptr())
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    seen["float32"] = max(seen["float32"], t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, positions, hidden_size, generator=g).bfloat16().requires_grad_()
    output_layer = torch.nn.Linear(hidden_size, vocabulary, bias=False).bfloat16()
    targets = torch.randint(0, vocabulary, (rows, positions - 1), generator=g)
    old, logprob_chunks.CHUNK_TOKENS = logprob_chunks.CHUNK_TOKENS, chunk_tokens
    try:
        with Tracker():
            logprobs, _ = logprob_chunks.chunked_logprobs(hidden, output_layer, targets, 1.0, with_entropy=True)
            logprobs.sum().backward()
    finally:
        logprob_chunks.CHUNK_TOKENS = old
    return seen["peak"], seen["float32"], rows * positions * vocabulary


def test_no_float32_tensor_spans_the_whole_logits_forward_or_backward():
    """Each float32 tensor is one chunk's (256 tokens: 128 positions of 2 rows); taken whole, one spans them all."""
    _, largest, values = log_prob_memory(256)
    assert largest == 256 * 4096
    _, largest, values = log_prob_memory(10**9)  # one chunk: the whole form
    assert largest >= values * 1024 // 1025


def test_the_plans_logit_bytes_are_what_the_chunks_hold():
    """dry_run's memory plan: nothing a value of the whole micro-batch's logits, CHUNK_BYTES a value of one chunk."""
    from dry_run import CHUNK_BYTES

    (small, _, n_small), (large, _, n_large), (wide, _, _) = (
        log_prob_memory(chunk, positions=positions) for chunk, positions in ((256, 1025), (256, 2049), (512, 2049)))
    whole = (large - small) / (n_large - n_small)  # per value of the logits: the chunk's share cancels
    chunk = (wide - large) / (256 * 4096)  # per value of a chunk: the whole's share cancels
    assert whole < 0.1  # the hidden states and their gradient: 2 x 2 bytes a hidden unit, 1/64 of a logit here
    assert chunk == pytest.approx(CHUNK_BYTES, rel=0.1)
    assert large <= 0.1 * n_large + CHUNK_BYTES * 256 * 4096 + 1e6  # the plan holds the peak


@pytest.mark.parametrize("sign", [+1.0, -1.0])
def test_one_step_moves_the_trajectory_logprob_the_way_of_its_advantage(policy, sign):
    trajectory = random_trajectories(1)[0]
    trajectory.advantage = sign
    before = summed_logprob(policy, trajectory)
    cfg = GRPOConfig(lr=1e-4, num_minibatches=1)
    grpo_step(policy, make_optimizer(policy, cfg), [trajectory], cfg)
    after = summed_logprob(policy, trajectory)
    assert (after - before) * sign > 0.01


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean", "token-sum"])
def test_micro_batch_size_does_not_change_the_update(policy, aggregation):
    trajectories = random_trajectories(5)
    results = []
    for micro in (1, 2, 5):
        model = copy.deepcopy(policy)
        cfg = GRPOConfig(num_minibatches=1, micro_batch_size=micro, aggregation=aggregation, max_grad_norm=1e9,
                         max_response_tokens=32)
        grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), trajectories, cfg)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.detach().flatten() for p in policy.parameters()])
    assert (results[0] - start).abs().max() > 1e-3  # the step did move the weights
    for other in results[1:]:
        assert torch.allclose(results[0], other, atol=1e-5)


def test_gradient_checkpointing_does_not_change_the_update(policy):
    trajectories = random_trajectories(3)
    results = []
    for checkpointing in (False, True):
        model = copy.deepcopy(policy)
        cfg = GRPOConfig(num_minibatches=1, gradient_checkpointing=checkpointing, max_grad_norm=1e9)
        grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), trajectories, cfg)
        assert model.is_gradient_checkpointing == checkpointing
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(results[0], results[1], atol=1e-5)


def test_first_minibatch_sees_ratio_one_and_no_clipping(policy):
    cfg = GRPOConfig(num_minibatches=1, micro_batch_size=2)
    metrics = grpo_step(policy, make_optimizer(policy, cfg), random_trajectories(4), cfg)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_low_frac"] == 0 and metrics["clip_high_frac"] == 0
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-9)


def test_pi_old_pass_runs_the_updates_micro_batches_so_unmoved_weights_give_ratio_one_exactly(policy):
    """Two mini-batches at lr 0: pi_old's pass, in micro-batches of its own, padded otherwise, gave ratios 1 +- 5e-7."""
    g = torch.Generator().manual_seed(0)
    trajectories = [make_trajectory(torch.randint(3, 400, (3 + i % 3,), generator=g).tolist(),
                                    torch.randint(3, 400, (8 + int(torch.randint(0, 30, (1,), generator=g)),),
                                                  generator=g).tolist(), advantage=(-1.0) ** i) for i in range(12)]
    cfg = GRPOConfig(lr=0.0, weight_decay=0.0, num_minibatches=2, micro_batch_size=3)
    metrics = grpo_step(policy, make_optimizer(policy, cfg), trajectories, cfg)
    assert (metrics["ratio_max"], metrics["ratio_mean"], metrics["approx_kl"]) == (1.0, 1.0, 0.0)


def test_no_forward_runs_for_a_metric_alone_entropy_and_mismatch_describe_the_rows_the_update_runs(policy):
    """Zero-advantage rows get neither pi_old's pass nor the update's; the entropy and the mismatch are over the
    tokens the update computed on, as a pass over those rows alone gives them."""
    trajectories = random_trajectories(5) + random_trajectories(5, seed=1)
    for t in trajectories[1::3]:
        t.advantage = 0.0
    g = torch.Generator().manual_seed(2)
    for t in trajectories:
        t.logprobs = [-float(x) * m for x, m in zip(torch.rand(len(t.token_ids), generator=g), t.loss_mask)]
    trained = [t for t in trajectories if t.advantage != 0]
    for minibatches in (1, 2):
        model, forwards = copy.deepcopy(policy), []
        model.register_forward_hook(lambda module, args, output: forwards.append(len(output.logits)))
        cfg = GRPOConfig(lr=1e-3, num_minibatches=minibatches, micro_batch_size=2)
        metrics = grpo_step(model, make_optimizer(model, cfg), trajectories, cfg)
        later = [t for t in trajectories[5:] if t.advantage != 0] if minibatches == 2 else []  # the second half's
        assert sum(forwards) == len(trained) + len(later)  # the update's, and pi_old's own pass for the second half
        assert metrics["rows_skipped"] == len(trajectories) - len(trained)
        batch = build_batch(trained)
        mask = batch.loss_mask.bool()
        with torch.no_grad():
            gap = (token_logprobs(policy, batch) - batch.sampler_logprobs)[mask]
        assert metrics["computed_tokens"] == mask.sum()
        assert metrics["mismatch_abs"] == pytest.approx(float(gap.abs().mean()), rel=1e-5)
        assert metrics["mismatch_max"] == pytest.approx(float(gap.abs().max()), rel=1e-5)
    for t in trajectories:
        t.advantage = 0.0
    metrics = grpo_step(policy, make_optimizer(policy, cfg), trajectories, cfg)  # nothing ran: nothing to describe
    assert all(math.isnan(metrics[key]) for key in ("entropy", "mismatch_abs", "mismatch_max", "mismatch_kl"))


@pytest.mark.parametrize("skip,minibatches", [(True, 1), (False, 1), (True, 2)])
def test_the_first_minibatch_takes_pi_old_from_its_own_forward_and_the_step_is_the_same(policy, monkeypatch, skip,
                                                                                         minibatches):
    """No TIS: the first mini-batch's old log-probs are its own forwards', detached; only the later mini-batches'
    rows take a pass of their own. Loss, weights and every metric are the step with a pass for every row (forced
    here), minus the first mini-batch's share of that pass."""
    trajectories = random_trajectories(5)
    trajectories[1].advantage = 0.0  # skipped: no forward, neither for the update nor for a metric
    cfg = GRPOConfig(num_minibatches=minibatches, micro_batch_size=2, skip_zero_advantage=skip, max_grad_norm=1e9)

    def step():  # SGD at lr 1: the weights move by the gradient itself (AdamW's first step is its sign)
        model, forwards = copy.deepcopy(policy), []
        model.register_forward_hook(lambda module, args, output: forwards.append(len(output.logits)))
        metrics = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), trajectories, cfg)
        return flat_weights(model), metrics, forwards

    weights, metrics, forwards = step()
    monkeypatch.setattr("grpo.first_minibatch_gives_pi_old", lambda cfg: False)  # a pass of their own for every row
    weights_before, metrics_before, forwards_before = step()
    # two mini-batches: rows 0-2 (row 1 skipped) and rows 3-4, a micro-batch of 2 each
    update = {(True, 1): [2, 2], (False, 1): [1, 2, 2], (True, 2): [2, 2]}[skip, minibatches]
    later = {1: [], 2: [2]}[minibatches]  # the old pass: the second mini-batch's rows only
    assert sorted(forwards) == sorted(update + later)
    assert sorted(forwards_before) == sorted(update + update)  # the forced pass runs the update's passes, no more
    assert (weights - flat_weights(policy)).abs().max() > 1e-4
    assert torch.allclose(weights, weights_before, atol=1e-6, rtol=0)
    assert metrics.keys() == metrics_before.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(metrics_before[key], rel=1e-5, abs=1e-6), key
    if minibatches == 1:
        assert metrics["ratio_max"] == 1.0 and metrics["approx_kl"] == 0.0  # exactly: the same forward


def test_later_minibatches_see_the_policy_move(policy):
    cfg = GRPOConfig(lr=1e-3, num_minibatches=2, micro_batch_size=2)
    metrics = grpo_step(policy, make_optimizer(policy, cfg), random_trajectories(4), cfg)
    assert metrics["optimizer_steps"] == 2
    assert metrics["approx_kl"] > 0
    assert metrics["ratio_max"] > 1.0


def test_metrics_are_flat_floats(policy):
    cfg = GRPOConfig(num_minibatches=2, micro_batch_size=2)
    metrics = grpo_step(policy, make_optimizer(policy, cfg), random_trajectories(3), cfg)
    expected = {"loss", "grad_norm", "clip_low_frac", "clip_high_frac", "ratio_mean", "ratio_max",
                "approx_kl", "entropy", "mismatch_abs", "mismatch_max", "mismatch_kl", "tokens",
                "informative_frac", "sequences", "excluded_sequences", "rows_skipped", "optimizer_steps", "skipped_steps"}
    assert expected <= set(metrics)
    assert all(type(k) is str and type(v) is float and math.isfinite(v) for k, v in metrics.items())
    assert metrics["tokens"] == sum(sum(t.loss_mask) for t in random_trajectories(3))


def test_adamws_moments_exist_before_the_first_step_and_train_exactly_as_its_own(policy):
    """make_optimizer makes AdamW's state at once (before vLLM takes its share of the GPU, not inside the first
    update); two steps from it give the same weights and state, to the bit, as AdamW's lazily made state."""
    cfg = GRPOConfig(lr=1e-3, num_minibatches=2, micro_batch_size=2)
    eager_model, lazy_model = policy, copy.deepcopy(policy)
    initial = [p.detach().clone() for p in policy.parameters()]
    eager = make_optimizer(eager_model, cfg)
    params = list(eager_model.parameters())
    assert len(eager.state) == len(params)
    for p in params:
        state = eager.state[p]
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert state["exp_avg"].shape == p.shape and state["exp_avg"].device == p.device
    lazy = torch.optim.AdamW(lazy_model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    assert not lazy.state
    for seed in (0, 1):
        for model, optimizer in ((eager_model, eager), (lazy_model, lazy)):
            trajectories = random_trajectories(4, seed=seed)
            grpo_step(model, optimizer, trajectories, cfg)
    assert all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), lazy_model.parameters()))
    assert max(float((a.detach() - b).abs().max()) for a, b in zip(params, initial)) > 1e-4  # the steps moved the weights
    for a, b in zip(params, lazy_model.parameters()):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(eager.state[a][key], lazy.state[b][key]), key


def test_bf16_master_weights_are_refused(policy):
    with pytest.raises(ValueError, match="float32"):
        make_optimizer(policy.to(torch.bfloat16), GRPOConfig())


# --------------------------------------------------------------------------- options from the field


def flat_weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def sgd_step(policy, trajectories, exclude=None, **cfg):
    """Weights after one grpo_step with plain SGD (lr 1, no norm clip): the update is the raw gradient."""
    model = copy.deepcopy(policy)
    config = GRPOConfig(**{"num_minibatches": 1, "max_grad_norm": 1e9, **cfg})
    metrics = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), trajectories, config, exclude=exclude)
    return flat_weights(model), metrics


def test_truncated_importance_weights_multiply_each_token_term_by_hand():
    logprobs, old, adv, mask = hand_case()
    weights = torch.tensor([[0.5, 2.0, 7.0], [1.0, 0.25, 2.0]])  # [0, 2] is padding
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "token-mean", token_weights=weights)
    expected = (0.5 * -1.28 + 2.0 * -0.5 + 1.0 * 1.1 + 0.25 * 0.8 + 2.0 * 1.6) / 5
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # a weight scales the gradient of its token and nothing else; the clipped stay at zero
    assert float(logprobs.grad[0, 1]) == pytest.approx(2.0 * -0.5 / 5, abs=1e-6)
    assert float(logprobs.grad[1, 2]) == pytest.approx(2.0 * 1.6 / 5, abs=1e-6)
    assert logprobs.grad[0, 0] == 0 and logprobs.grad[1, 1] == 0 and logprobs.grad[0, 2] == 0


def with_sampler_gap(policy, trajectories, factors):
    """Set each trajectory's recorded log-probs so that pi_old / pi_sampler is `factors[i]` on every token."""
    for t, k in zip(trajectories, factors):
        lp = trainer_scores(policy, t).tolist()
        it = iter(lp)
        t.logprobs = [next(it) - math.log(k) if m else 0.0 for m in t.loss_mask]
    return trajectories


def test_tis_weight_is_old_over_sampler_capped_and_scales_the_update(policy):
    base = random_trajectories(3)
    plain, _ = sgd_step(policy, base)
    start = flat_weights(policy)
    # ratios 0.5 (kept), 1.5 (kept), 4.0 (capped at 2): weights 0.5, 1.5, 2.0 per trajectory
    gapped = with_sampler_gap(policy, random_trajectories(3), [0.5, 1.5, 4.0])
    tokens = [sum(t.loss_mask) for t in gapped]
    tis, metrics = sgd_step(policy, gapped, tis_cap=2.0)
    assert metrics["tis_weight_mean"] == pytest.approx((0.5 * tokens[0] + 1.5 * tokens[1] + 2.0 * tokens[2]) / sum(tokens), abs=1e-4)
    assert metrics["tis_capped_frac"] == pytest.approx(tokens[2] / sum(tokens))
    # the same weight on every token of a one-trajectory step scales the SGD update by that weight
    for k, w in ((0.5, 0.5), (4.0, 2.0)):
        one = with_sampler_gap(policy, random_trajectories(1), [k])
        plain_one, _ = sgd_step(policy, random_trajectories(1))
        weighted, m = sgd_step(policy, one, tis_cap=2.0)
        assert torch.allclose(weighted - start, w * (plain_one - start), atol=1e-5, rtol=1e-3)
        assert m["tis_capped_frac"] == (1.0 if k > 2 else 0.0)
    assert not torch.allclose(tis, plain, atol=1e-5)


def test_tis_off_logs_no_tis_metrics_and_leaves_the_update_alone(policy):
    gapped = with_sampler_gap(policy, random_trajectories(3), [0.5, 1.5, 4.0])
    plain, metrics = sgd_step(policy, random_trajectories(3))
    off, metrics_off = sgd_step(policy, gapped)
    assert torch.allclose(plain, off, atol=1e-6)
    assert not any("tis" in k for k in metrics_off)


def test_token_sum_divides_every_token_by_budget_times_sequences_by_hand():
    logprobs, old, adv, mask = hand_case()
    budget = 4
    loss, _ = clipped_policy_loss(logprobs, old, adv, mask, 0.2, 0.28, "token-sum", normalizer=budget * 2)
    assert float(loss.detach()) == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8 + 1.6) / 8, abs=1e-6)
    loss.backward()
    # one constant for both sequences: 2 and 3 model tokens, the same 1/8 per token
    assert float(logprobs.grad[0, 1]) == pytest.approx(-0.5 / 8, abs=1e-6)
    assert float(logprobs.grad[1, 0]) == pytest.approx(1.1 / 8, abs=1e-6)
    with pytest.raises(ValueError, match="normalizer"):
        clipped_policy_loss(logprobs, old, adv, mask, aggregation="token-sum")


def test_token_sum_step_equals_the_token_mean_step_rescaled(policy):
    # One mini-batch: token-sum's constant is budget x sequences, token-mean's is the
    # token count N, so the SGD updates differ by exactly N / (budget x sequences).
    trajectories = random_trajectories(4)
    start = flat_weights(policy)
    mean_step, _ = sgd_step(policy, trajectories)
    sum_step, _ = sgd_step(policy, trajectories, aggregation="token-sum", max_response_tokens=40)
    n = sum(sum(t.loss_mask) for t in trajectories)
    assert torch.allclose(sum_step - start, (mean_step - start) * n / (40 * 4), atol=1e-6, rtol=1e-3)
    with pytest.raises(ValueError, match="max_response_tokens"):
        sgd_step(policy, trajectories, aggregation="token-sum")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_skipping_zero_advantage_rows_changes_no_weight(policy, optimizer):
    # Mini-batch 1 holds one row with gradient and one without; mini-batch 2 only
    # rows without: skipped entirely, AdamW must still take its (momentum) step.
    trajectories = random_trajectories(4)
    for t, a in zip(trajectories, [1.5, 0.0, 0.0, 0.0]):
        t.advantage = a
    results = []
    for skip in (False, True):
        model = copy.deepcopy(policy)
        cfg = GRPOConfig(lr=1e-3, num_minibatches=2, micro_batch_size=1, max_grad_norm=1e9, skip_zero_advantage=skip)
        opt = torch.optim.SGD(model.parameters(), lr=1.0) if optimizer == "sgd" else make_optimizer(model, cfg)
        metrics = grpo_step(model, opt, trajectories, cfg)
        assert metrics["rows_skipped"] == (3 if skip else 0)
        assert metrics["optimizer_steps"] == 2
        results.append(flat_weights(model))
    assert (results[0] - flat_weights(policy)).abs().max() > 1e-4
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_zero_advantage_tokens_shrink_the_token_mean_step_by_the_informative_share(policy):
    # Under token-mean the zero-advantage rows add no gradient but count in the
    # denominator: the step is the informative rows' own step times their token share.
    informative = random_trajectories(2)
    idle = random_trajectories(3, seed=1)
    for t in idle:
        t.advantage = 0.0
    alone, _ = sgd_step(policy, informative)
    diluted, metrics = sgd_step(policy, informative + idle)
    share = sum(sum(t.loss_mask) for t in informative) / sum(sum(t.loss_mask) for t in informative + idle)
    assert metrics["informative_frac"] == pytest.approx(share)
    assert 0.2 < share < 0.8
    start = flat_weights(policy)
    assert torch.allclose(diluted - start, share * (alone - start), atol=1e-6)
    assert sgd_step(policy, informative)[1]["informative_frac"] == 1.0


def test_excluded_trajectory_gets_no_gradient_and_leaves_the_denominator(policy):
    kept, dropped = random_trajectories(2)
    alone, _ = sgd_step(policy, [kept])
    together, metrics = sgd_step(policy, [kept, dropped], exclude=[False, True])
    assert torch.allclose(alone, together, atol=1e-6)
    assert metrics["excluded_sequences"] == 1 and metrics["tokens"] == sum(kept.loss_mask)
    with pytest.raises(ValueError, match="exclude has 1 entries for 2"):
        sgd_step(policy, [kept, dropped], exclude=[True])


# --------------------------------------------------------------------------- with vLLM

# 300 tokens: more than one of vLLM's cache blocks (128 tokens on CPU), so the
# prefix cache holds this prompt between requests.
PROMPT = torch.randint(3, 400, (300,), generator=torch.Generator().manual_seed(1)).tolist()


def sample(llm, prompt, seed, max_tokens=24):
    """One trajectory as the sampler records it: token ids and vLLM's log-prob of each."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    ids = list(out.token_ids)
    logprobs = [out.logprobs[i][t].logprob for i, t in enumerate(ids)]
    return make_trajectory(prompt, ids, logprobs=logprobs, advantage=1.0)


def vllm_scores(llm, trajectory):
    """vLLM's log-prob of each response token of a fixed sequence (prompt log-probs)."""
    from vllm import SamplingParams

    ids = trajectory.prompt_ids + trajectory.token_ids
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    start = len(trajectory.prompt_ids)
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(start, len(ids))])


def trainer_scores(model, trajectory):
    batch = build_batch([trajectory])
    with torch.no_grad():
        return token_logprobs(model, batch)[batch.loss_mask.bool()]


@pytest.mark.vllm
def test_sampler_and_trainer_logprobs_agree_before_any_step(tiny_llm, policy):
    trajectory = sample(tiny_llm, PROMPT, seed=1)
    recorded = torch.tensor(trajectory.logprobs)
    assert (trainer_scores(policy, trajectory) - recorded).abs().max() < LOGPROB_TOL
    cfg = GRPOConfig(num_minibatches=1)
    metrics = grpo_step(policy, make_optimizer(policy, cfg), [trajectory], cfg)
    assert metrics["mismatch_max"] < LOGPROB_TOL


@pytest.mark.vllm
def test_after_step_and_sync_vllm_scores_like_the_trainer(tiny_llm, tiny_model_path, policy):
    trajectory = sample(tiny_llm, PROMPT, seed=1)  # also leaves PROMPT in the prefix cache
    before = vllm_scores(tiny_llm, trajectory)
    version = getattr(tiny_llm, "weight_version", 0)
    cfg = GRPOConfig(lr=1e-3, num_minibatches=1)
    grpo_step(policy, make_optimizer(policy, cfg), [trajectory], cfg)
    try:
        assert sync_weights(policy, tiny_llm) == version + 1
        assert tiny_llm.weight_version == version + 1
        after = vllm_scores(tiny_llm, trajectory)
        assert (after - trainer_scores(policy, trajectory)).abs().max() < LOGPROB_TOL
        assert (after - before).abs().max() > 0.05  # the step really changed the sampler
        # a new sample from the cached prompt comes from the new weights, prefix included
        fresh = sample(tiny_llm, PROMPT, seed=2)
        assert (trainer_scores(policy, fresh) - torch.tensor(fresh.logprobs)).abs().max() < LOGPROB_TOL
    finally:  # the engine is shared by the whole session: put the original weights back
        sync_weights(load_policy(tiny_model_path, device="cpu"), tiny_llm)
        tiny_llm.weight_version = version
    assert (vllm_scores(tiny_llm, trajectory) - before).abs().max() < LOGPROB_TOL


@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the sampler really sleeps")
def test_sleep_sampler_does_nothing_on_cpu(tiny_llm):
    assert sleep_sampler(tiny_llm) is False
    assert not tiny_llm.llm_engine.is_sleeping()


# --------------------------------------------------------------------------- several tool calls, through vLLM

CODE_TURN = r"```python\nprint\([1-9] \* [1-9]\)\n```\n```output"
ANSWER_TURN = r"So \\boxed\{[1-4]\}"


class RecordingLLM:
    """The shared engine, keeping every generate call's prompts and outputs."""

    def __init__(self, llm) -> None:
        self._llm = llm
        self.calls: list[tuple[list, list]] = []

    def generate(self, prompts, params, **kwargs):
        outs = self._llm.generate(prompts, params, **kwargs)
        self.calls.append((prompts, outs))
        return outs

    def __getattr__(self, name):
        return getattr(self._llm, name)


@pytest.mark.vllm
def test_three_tool_calls_keep_spans_exact_from_sampler_to_trainer(tiny_llm, sandbox, policy):
    """C = 3: every observation masked, every model token kept with vLLM's log-prob, in the trainer's columns too.

    The three code turns are forced (a random model writes no code); vLLM applies the
    regex before it records log-probs, so there the sampler's numbers are those of the
    constrained distribution, at least the trainer's. The fourth turn, after all three
    observations, is free: there sampler and trainer must agree token for token.
    """
    from rollout import RolloutConfig, rollout

    llm = RecordingLLM(tiny_llm)
    cfg = RolloutConfig(group_size=2, tool_budget=3, max_response_tokens=160, seed=3, schedule="rounds",  # calls recorded
                        force_turns=(CODE_TURN, CODE_TURN, CODE_TURN))
    problems = [{"id": "c3", "question": "What is 1 + 2?", "answer": "3"}]
    trajectories = rollout(llm, problems, sandbox, cfg)
    returned = {}  # (context sent, sample index) -> (token ids, log-probs) as vLLM returned them
    for prompts, outs in llm.calls:
        for p, out in zip(prompts, outs):
            for o in out.outputs:
                returned[(tuple(p["prompt_token_ids"]), o.index)] = (list(o.token_ids), [o.logprobs[i][tok].logprob for i, tok in enumerate(o.token_ids)])
    assert len(llm.calls) == 4
    for t in trajectories:
        assert t.num_tool_calls == 3 and all(c.ok for c in t.tool_calls)
        observed = [i for c in t.tool_calls for i in range(c.start, c.end)]
        assert [i for i, m in enumerate(t.loss_mask) if m == 0] == observed  # every observation token masked
        starts = [0] + [c.end for c in t.tool_calls]
        ends = [c.start for c in t.tool_calls] + [len(t.token_ids)]
        for k, (a, b) in enumerate(zip(starts, ends)):  # every model turn kept whole, with its log-probs
            ids, lps = returned[(tuple(t.prompt_ids + t.token_ids[:a]), t.group_index if k == 0 else 0)]
            assert t.token_ids[a:b] == ids and t.logprobs[a:b] == lps and t.loss_mask[a:b] == [1] * len(ids)
        assert ends[-1] > starts[-1], "the free fourth turn must have written something"
        assert sum(b - a for a, b in zip(starts, ends)) + len(observed) == len(t.token_ids)
        # In the trainer's batch: the scored columns hold exactly the model's tokens and their log-probs.
        t.advantage = 1.0
        batch = build_batch([t])
        scored = batch.loss_mask[0].bool()
        model_tokens = [i for i, m in enumerate(t.loss_mask) if m]
        assert batch.input_ids[0, 1:][scored].tolist() == [t.token_ids[i] for i in model_tokens]
        assert batch.sampler_logprobs[0][scored].tolist() == torch.tensor([t.logprobs[i] for i in model_tokens]).tolist()
        trainer = trainer_scores(policy, t)
        sampler = torch.tensor([t.logprobs[i] for i in model_tokens])
        free = torch.tensor([i >= starts[-1] for i in model_tokens])
        assert (trainer[free] - sampler[free]).abs().max() < LOGPROB_TOL  # after three observations, still aligned
        assert (sampler[~free] >= trainer[~free] - LOGPROB_TOL).all()  # forced: renormalised over what the regex allows


# --------------------------------------------------------------------------- the options in the loop (05-retool)


def test_informative_groups_keeps_groups_whose_rewards_differ_then_fills_at_the_bound():
    from batch_filters import informative_groups

    def group(*rewards):
        return [(Trajectory("p", i, "", [1], [2], [0.0], [1], "", reward=r), None) for i, r in enumerate(rewards)]

    first = [group(1, 1), group(-1, 1), group(-1, -1)]
    asked = []

    def more(r):
        asked.append(r)
        return [group(1, -1), group(1, 1)]

    kept, drawn, rounds = informative_groups(first, more, want=2, max_rounds=3)
    assert [[t.reward for t, _ in g] for g in kept] == [[-1, 1], [1, -1]]
    assert (drawn, rounds, asked) == (5, 1, [1])
    # nothing informative to be had: the bound stops it, degenerate groups fill the step in order
    asked.clear()
    kept, drawn, rounds = informative_groups([group(1, 1), group(-1, -1)], lambda r: asked.append(r) or [group(-1, -1)],
                                             want=2, max_rounds=2)
    assert (drawn, rounds, asked) == (4, 2, [1, 2])
    assert [[t.reward for t, _ in g] for g in kept] == [[1, 1], [-1, -1]]


def test_void_turn_is_a_turn_with_neither_complete_code_nor_an_answer(tiny_tokenizer):
    from batch_filters import void_turns
    from rollout import ToolCall

    def traj(*segments):
        """Segments alternate model text, observation text, model text, ..."""
        ids, calls = [], []
        for k, text in enumerate(segments):
            piece = tiny_tokenizer.encode(text, add_special_tokens=False)
            if k % 2:
                calls.append(ToolCall("x", True, False, 0, 0.0, text, len(ids), len(ids) + len(piece)))
            ids += piece
        return Trajectory("p", 0, "", [1], ids, [0.0] * len(ids), [1] * len(ids), "", tool_calls=calls)

    code = "```python\nprint(2)\n```\n```output"
    assert void_turns(traj(code, "\n2\n```\n", "So \\boxed{2}."), tiny_tokenizer) == 0
    assert void_turns(traj("The answer is \\boxed{7}."), tiny_tokenizer) == 0
    assert void_turns(traj("Let me think about it"), tiny_tokenizer) == 1  # e.g. cut by the budget
    assert void_turns(traj("```python\nprint(2)\n```output", "\nError\n```\n", "So \\boxed{2}."), tiny_tokenizer) == 1
    assert void_turns(traj(code, "\n2\n```\n", code, "\n2\n```\n", "hmm"), tiny_tokenizer) == 1  # the third turn


def test_options_are_off_in_the_torl_presets_and_flags_of_the_loop():
    from retool import PRESETS, make_config, parse_args

    for name in PRESETS:
        if name.startswith("torl"):
            cfg = make_config(name, {})
            assert (cfg.tis_cap, cfg.dynamic_sampling, cfg.mask_truncated, cfg.filter_void_turns) == (0.0, False, False, False)
            assert cfg.aggregation != "token-sum"
    args, overrides = parse_args(["--tis-cap", "2.0", "--dynamic-sampling", "true", "--mask-truncated", "true",
                                  "--filter-void-turns", "true", "--tool-budget", "2", "--aggregation", "token-sum"])
    cfg = make_config(args.preset, overrides)
    assert (cfg.tis_cap, cfg.dynamic_sampling, cfg.mask_truncated, cfg.filter_void_turns, cfg.tool_budget) == (2.0, True, True, True, 2)


@pytest.mark.parametrize("change, message", [
    (dict(aggregation="token-sum", scale_advantages=True), "drops the std scaling"),
    (dict(tis_cap=0.5), "a cap below 1"),
    (dict(dynamic_sampling=True, dynamic_sampling_rounds=0), "dynamic_sampling_rounds must be at least 1"),
    (dict(aggregation="sum"), "token-sum, got 'sum'"),
])
def test_bad_option_combinations_fail_with_one_line(change, message):
    from configuration import check_config
    from retool import Config

    with pytest.raises(SystemExit) as e:
        check_config(Config(**change))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.vllm
def test_all_options_run_together_in_a_real_step(tiny_llm, sandbox, tiny_model_path, policy):
    """--tis-cap 2 --dynamic-sampling --mask-truncated --filter-void-turns --tool-budget 2, one real step."""
    import dataclasses

    from batch_filters import void_turns
    from retool import Config, train_step
    from rollout import RolloutConfig

    cfg = Config(tis_cap=2.0, dynamic_sampling=True, dynamic_sampling_rounds=2, mask_truncated=True,
                 filter_void_turns=True, tool_budget=2, group_size=4, problems_per_step=2, max_response_tokens=64)
    # Turn one either closes its block (a real call) or leaves it open (a void turn); the
    # answer is a guess at 1..4, so groups are sometimes informative; some run out of budget.
    unclosed = r"```python\nprint\(3\)\n```output"
    rollout_cfg = RolloutConfig(group_size=4, tool_budget=2, max_response_tokens=64, seed=11,
                                force_turns=(f"({CODE_TURN}|{unclosed})", f"({ANSWER_TURN}|[a-z ]{{60}})"))
    grpo_cfg = GRPOConfig(lr=1e-3, num_minibatches=2, micro_batch_size=4, tis_cap=2.0, max_response_tokens=64)
    problems = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    version = tiny_llm.weight_version = getattr(tiny_llm, "weight_version", 0)
    try:
        metrics, trajectories = train_step(tiny_llm, policy, make_optimizer(policy, grpo_cfg), problems, sandbox,
                                           rollout_cfg, grpo_cfg, cfg, more_problems=lambda r: problems)
    finally:  # the engine is shared by the whole session: put the original weights back
        sync_weights(load_policy(tiny_model_path, device="cpu"), tiny_llm)
        tiny_llm.weight_version = version
    assert len(trajectories) == 8 and metrics["weight_version"] == version + 1
    assert metrics["problems_drawn"] >= 2 and metrics["problems_drawn"] == 2 * (1 + metrics["dynamic_rounds"])
    assert metrics["degenerate_groups"] == 0 or metrics["dynamic_rounds"] == 2
    void = [void_turns(t, tiny_llm.get_tokenizer()) > 0 for t in trajectories]
    assert metrics["void_filtered"] == sum(void) == metrics["void_trajectories"]
    assert metrics["truncated_masked"] == sum(t.truncated for t in trajectories)
    assert metrics["excluded_sequences"] == sum(v or t.truncated for v, t in zip(void, trajectories))
    # forced tokens: the sampler's log-probs are the regex-constrained ones, at least the
    # trainer's, so every weight is at most 1 and the cap of 2 never binds (0 when nothing is trained)
    assert (0 < metrics["tis_weight_mean"] <= 1 + 1e-4) if metrics["tokens"] else metrics["tis_weight_mean"] == 0
    assert metrics["tis_capped_frac"] == 0.0
    assert any("truncat" in k for k in metrics) and any("void" in k for k in metrics)
    # the update's and the options' numbers (outcome ratios of an empty set, e.g. code
    # use among correct answers when none is correct, are NaN by design)
    for key in ("loss", "grad_norm", "tokens", "tis_weight_mean", "problems_drawn", "void_filtered", "truncated_masked"):
        assert math.isfinite(metrics[key]), key


def test_a_failing_weight_load_still_joins_every_gather_and_raises(policy, monkeypatch):
    """The loader fails after two tensors: the rest are still gathered (other ranks wait in those), then it raises."""
    from types import SimpleNamespace

    import vllm.v1.engine.core_client as core_client

    import weight_sync

    gathered = []
    monkeypatch.setattr(weight_sync, "full_tensor", lambda t: gathered.append(t) or t)

    class Core:
        pass

    monkeypatch.setattr(core_client, "InprocClient", Core)

    def loader_that_fails(fn, args):
        weights = iter(args[0])
        next(weights), next(weights)
        raise RuntimeError("a shape vLLM did not expect")

    engine = SimpleNamespace(engine_core=Core(), is_sleeping=lambda: False,
                             vllm_config=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))
    llm = SimpleNamespace(llm_engine=engine, collective_rpc=loader_that_fails)
    with pytest.raises(RuntimeError, match="vLLM's loader failed on a rank") as e:
        weight_sync.sync_weights(policy, llm)
    assert "did not expect" in str(e.value.__cause__)
    assert len(gathered) == len(list(policy.parameters()))


def test_a_sleeping_sampler_is_woken_weights_first_after_torchs_cache_is_freed_then_loaded_then_its_kv_cache(
        policy, monkeypatch):
    """The order of vLLM's calls on CUDA (a fake engine records them; only their order matters): the update sleeps
    vLLM at level 2 (weights and KV cache dropped); the sync frees torch's cache before the weights' wake (vLLM maps
    that memory outside torch's allocator), loads every weight, frees the load's copies, then wakes the KV cache,
    and the prefix cache is reset."""
    from types import SimpleNamespace

    import vllm.v1.engine.core_client as core_client

    import weight_sync

    calls, state = [], {"asleep": False}

    class Core:
        pass

    monkeypatch.setattr(core_client, "InprocClient", Core)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def sleep(level):
        calls.append(f"sleep level {level}")
        state["asleep"] = True

    def wake_up(tags):
        calls.append(f"wake {','.join(tags)}")
        state["asleep"] = tags != ["kv_cache"]

    def load(fn, args):
        calls.append(f"load {len(list(args[0]))} weights")

    config = SimpleNamespace(dtype=torch.bfloat16, enable_sleep_mode=True)
    engine = SimpleNamespace(engine_core=Core(), is_sleeping=lambda: state["asleep"],
                             vllm_config=SimpleNamespace(model_config=config))
    llm = SimpleNamespace(llm_engine=engine, sleep=sleep, wake_up=wake_up, collective_rpc=load,
                          reset_prefix_cache=lambda: calls.append("reset prefix cache") or True)
    assert weight_sync.sleep_sampler(llm) is True
    assert weight_sync.sync_weights(policy, llm) == 1
    assert calls == ["sleep level 2", "empty_cache", "wake weights", f"load {len(list(policy.parameters()))} weights",
                     "empty_cache", "wake kv_cache", "reset prefix cache"]
    calls.clear()  # awake (no sleep mode, or the CPU): the load alone
    weight_sync.sync_weights(policy, llm)
    assert calls == [f"load {len(list(policy.parameters()))} weights", "reset prefix cache"]


# --------------------------------------------------------------------------- the objectives after DAPO
# Each loss and its gradient against a reference written here, token by token in float64, with the gradient
# derived by hand (not by autograd): a missing detach, a wrong normaliser or a clip on the wrong side shows.

EPS = {"ppo-clip": (0.2, 0.28), "cispo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


def random_batch(seed, objective):
    """6 rows of uneven length (padding after), an observation hole, one excluded row (no model token), and
    log-probs far from each other (ppo-clip, cispo) or close (gspo) so that every clip region is visited."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 6, 9
    mask = torch.zeros(rows, width)
    for i, length in enumerate([9, 4, 7, 0, 2, 6]):  # row 3: excluded
        mask[i, :length] = 1
    mask[0, 3:5] = 0  # interpreter output
    mask[5, 1] = 0
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    spread = 5e-4 if objective == "gspo" else 0.35
    new = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread
    new[mask == 0] = 80.0  # padding and observations: exp would overflow; must not matter
    sampler = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.6
    advantage = torch.tensor([1.5, -0.5, 0.7, 2.0, -1.2, 0.0], dtype=torch.float64)
    return new, old, sampler, advantage, mask


def reference_weights(old, sampler, mask, cap, mode):
    """pi_old / pi_sampler per model token: truncated, or 1 / 0 inside / outside [1/cap, cap]."""
    w = torch.zeros_like(old)
    for i in range(old.shape[0]):
        cols = [t for t in range(old.shape[1]) if mask[i, t]]
        if not cols:
            continue
        geometric = math.exp(sum(float(old[i, t] - sampler[i, t]) for t in cols) / len(cols))
        for t in cols:
            ratio = math.exp(float(old[i, t] - sampler[i, t]))
            if mode == "truncate":
                w[i, t] = min(ratio, cap)
            elif mode == "token-mask":
                w[i, t] = 1.0 if 1 / cap <= ratio <= cap else 0.0
            else:
                w[i, t] = 1.0 if 1 / cap <= geometric <= cap else 0.0
    return w


def reference_loss_and_gradient(new, old, advantage, mask, objective, aggregation, weights):
    """(loss, d loss / d new) by the definitions, one token at a time."""
    eps_low, eps_high = EPS[objective]
    rows, width = new.shape
    cols = [[t for t in range(width) if mask[i, t]] for i in range(rows)]
    sequences = sum(1 for c in cols if c)
    tokens = sum(len(c) for c in cols)
    loss, grad = 0.0, torch.zeros_like(new)
    for i in range(rows):
        a, n = float(advantage[i]), len(cols[i])
        if not n:
            continue
        if objective == "gspo":  # one term per sequence, mean over sequences
            s = math.exp(sum(float(new[i, t] - old[i, t]) for t in cols[i]) / n)
            w = sum(float(weights[i, t]) for t in cols[i]) / n
            clipped = min(max(s, 1 - eps_low), 1 + eps_high)
            loss += -w * min(s * a, clipped * a) / sequences
            clip_acts = (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low)
            for t in cols[i]:
                grad[i, t] = 0.0 if clip_acts else -w * a * s / n / sequences
            continue
        share = {"token-mean": 1 / tokens, "sequence-mean": 1 / (n * sequences)}[aggregation]
        for t in cols[i]:
            r = math.exp(float(new[i, t] - old[i, t]))
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            w = float(weights[i, t])
            if objective == "ppo-clip":
                loss += -w * min(r * a, clipped * a) * share
                clip_acts = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
                grad[i, t] = 0.0 if clip_acts else -w * r * a * share
            else:  # cispo: the clipped ratio is a constant weight on log pi
                loss += -w * clipped * a * float(new[i, t]) * share
                grad[i, t] = -w * clipped * a * share
    return loss, grad


def combinations():
    for objective in ("ppo-clip", "cispo"):
        for aggregation in ("token-mean", "sequence-mean"):
            for mode in (None, "truncate", "token-mask", "sequence-mask"):
                yield objective, aggregation, mode
    yield "gspo", "sequence-mean", None
    yield "gspo", "sequence-mean", "sequence-mask"


@pytest.mark.parametrize("objective, aggregation, mode", list(combinations()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_objective_and_mode_matches_the_reference_loss_and_gradient(objective, aggregation, mode, seed):
    from grpo import OBJECTIVES
    from types import SimpleNamespace

    from update_options import tis_weights

    new, old, sampler, advantage, mask = random_batch(seed, objective)
    cap = 1.5
    if mode:
        batch = SimpleNamespace(loss_mask=mask, sampler_logprobs=sampler)
        weights, metrics = tis_weights(old, batch, cap, mode)
        expected = reference_weights(old, sampler, mask, cap, mode)
        assert torch.allclose(weights.double(), expected, atol=1e-9)
        if mode != "truncate":
            masked = (expected == 0) & (mask == 1)
            assert metrics["tis_masked_frac"] == pytest.approx(float(masked.sum() / mask.sum()))
            in_loss = mask.sum(1) > 0
            assert metrics["tis_masked_seq_frac"] == pytest.approx(float(masked.any(1)[in_loss].float().mean()))
    else:
        weights = None
    logprobs = new.clone().requires_grad_()
    eps_low, eps_high = EPS[objective]
    per_token_advantage = mask * advantage[:, None]  # as build_batch lays it out
    loss, stats = OBJECTIVES[objective](logprobs, old, per_token_advantage, mask, eps_low, eps_high, aggregation,
                                        token_weights=weights)
    loss.backward()
    ref_loss, ref_grad = reference_loss_and_gradient(new, old, advantage, mask, objective, aggregation,
                                                     weights if weights is not None else torch.ones_like(new))
    assert float(loss.detach()) == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    assert torch.isfinite(logprobs.grad).all()
    assert torch.allclose(logprobs.grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert stats["tokens"] == float(mask.sum())
    # the draw visits both sides of the clip (gspo: per sequence) and leaves some tokens unclipped
    if objective != "gspo" and seed == 0:
        assert stats["clip_low_frac"] > 0 and stats["clip_high_frac"] > 0
        assert stats["clip_low_frac"] + stats["clip_high_frac"] < 0.9


def test_gspo_draws_clip_some_sequences_and_not_others():
    from objectives import gspo_loss

    clipped = []
    for seed in (0, 1, 2):
        new, old, _, advantage, mask = random_batch(seed, "gspo")
        _, stats = gspo_loss(new, old, advantage, mask)
        clipped.append(stats["clip_low_frac"] + stats["clip_high_frac"])
    assert any(c > 0 for c in clipped) and all(c < 0.9 for c in clipped)


def test_micro_batches_with_the_mini_batch_normalizer_add_up_to_the_whole_loss():
    """Each objective: two halves of the rows, each divided by the whole's count, sum to the whole."""
    from grpo import OBJECTIVES
    from objectives import loss_denominator

    for objective, aggregation in (("gspo", "sequence-mean"), ("cispo", "token-mean"), ("cispo", "sequence-mean")):
        new, old, _, advantage, mask = random_batch(0, objective)
        eps = EPS[objective]
        whole, _ = OBJECTIVES[objective](new, old, advantage, mask, *eps, aggregation)
        n = loss_denominator(mask, aggregation, 0)
        halves = sum(OBJECTIVES[objective](new[r], old[r], advantage[r], mask[r], *eps, aggregation, normalizer=n)[0]
                     for r in (slice(0, 3), slice(3, 6)))
        assert float(halves) == pytest.approx(float(whole), rel=1e-9)


def test_gspo_by_hand_one_sequence_in_the_band_one_clipped():
    """Token ratios 1.001, 0.999 (A = +1): s = 0.9999995, full gradient s / 2 / 2 each; 1.001, 1.001 (A = +1):
    s = 1.001 > 1 + 4e-4, clipped, term -1.0004 and no gradient."""
    from objectives import gspo_loss

    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    ratios = torch.tensor([[1.001, 0.999], [1.001, 1.001]])
    logprobs = (old + ratios.log()).requires_grad_()
    loss, stats = gspo_loss(logprobs, old, torch.tensor([1.0, 1.0]), torch.ones(2, 2))
    s0 = math.sqrt(1.001 * 0.999)
    assert float(loss.detach()) == pytest.approx((-s0 - 1.0004) / 2, abs=1e-6)
    loss.backward()
    assert torch.allclose(logprobs.grad[0], torch.full((2,), -s0 / 2 / 2), atol=1e-6)
    assert (logprobs.grad[1] == 0).all()
    assert stats["clip_high_frac"] == 0.5 and stats["clip_low_frac"] == 0


def test_cispo_keeps_the_gradient_ppo_clip_removes():
    """The hand case's clipped tokens (r = 1.5 with A = +1, r = 0.7 with A = -1) get the clipped weight."""
    from objectives import cispo_loss

    logprobs, old, adv, mask = hand_case()
    loss, stats = cispo_loss(logprobs, old, adv, mask, 0.2, 0.28, "token-mean")
    loss.backward()
    g = logprobs.grad
    assert float(g[0, 0]) == pytest.approx(-1.28 / 5) and float(g[1, 1]) == pytest.approx(0.8 / 5)
    assert float(g[0, 1]) == pytest.approx(-0.8 / 5)  # r = 0.5 -> weight 0.8
    assert float(g[1, 2]) == pytest.approx(1.28 / 5)  # r = 1.6 -> weight 1.28
    assert g[0, 2] == 0  # padding
    assert stats["clip_high_frac"] == pytest.approx(2 / 5) and stats["clip_low_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("objective, against", [("cispo", {}), ("gspo", {"aggregation": "sequence-mean"})])
def test_at_ratio_one_each_objective_takes_ppo_clips_step(policy, objective, against):
    """One mini-batch sees ratio 1: CISPO's gradient is then PPO's; GSPO's is PPO's with sequence-mean.
    An excluded row and a zero-advantage row ride along."""
    trajectories = random_trajectories(4)
    trajectories[2].advantage = 0.0
    exclude = [False, True, False, False]
    eps = {"eps_low": 3e-4, "eps_high": 4e-4} if objective == "gspo" else {}
    theirs, metrics = sgd_step(policy, trajectories, exclude=exclude, objective=objective, **eps)
    ppo, _ = sgd_step(policy, trajectories, exclude=exclude, **against)
    assert (ppo - flat_weights(policy)).abs().max() > 1e-3
    assert torch.allclose(theirs, ppo, atol=1e-6)
    assert metrics["clip_low_frac"] == metrics["clip_high_frac"] == 0


def with_token_gaps(policy, trajectory, gaps):
    """Recorded log-probs such that pi_old / pi_sampler is gaps[k] on the k-th model token (1 elsewhere)."""
    lp = iter(trainer_scores(policy, trajectory).tolist())
    model_token = iter(range(len(trajectory.token_ids)))
    trajectory.logprobs = [next(lp) - math.log(gaps.get(next(model_token), 1.0)) if m else 0.0 for m in trajectory.loss_mask]
    return trajectory


def test_sequence_mask_zeroes_a_sequence_whose_geometric_mean_is_out_of_band_and_keeps_its_tokens_in_the_denominator(policy):
    kept, far = with_sampler_gap(policy, random_trajectories(2), [1.0, 4.0])  # far: every token 4x, mean 4 > cap 2
    alone, _ = sgd_step(policy, [kept])
    masked, metrics = sgd_step(policy, [kept, far], tis_cap=2.0, tis_mode="sequence-mask")
    share = sum(kept.loss_mask) / (sum(kept.loss_mask) + sum(far.loss_mask))
    start = flat_weights(policy)
    assert torch.allclose(masked - start, share * (alone - start), atol=1e-6)
    assert metrics["tis_masked_seq_frac"] == 0.5 and metrics["tis_masked_frac"] == pytest.approx(1 - share)
    assert metrics["tis_weight_mean"] == pytest.approx(share)


def test_token_mask_zeroes_one_token_where_sequence_mask_keeps_the_sequence(policy):
    t = random_trajectories(1)[0]
    with_token_gaps(policy, t, {0: 4.0, 1: 0.3})  # two tokens out of [1/2, 2]; geometric mean inside it
    n = sum(t.loss_mask)
    _, token = sgd_step(policy, [t], tis_cap=2.0, tis_mode="token-mask")
    _, sequence = sgd_step(policy, [t], tis_cap=2.0, tis_mode="sequence-mask")
    assert token["tis_masked_frac"] == pytest.approx(2 / n) and token["tis_masked_seq_frac"] == 1.0
    assert sequence["tis_masked_frac"] == 0.0 and sequence["tis_masked_seq_frac"] == 0.0
    assert token["tis_weight_mean"] == pytest.approx(1 - 2 / n)


@pytest.mark.parametrize("change, message", [
    (dict(objective="gspo"), "about 1000x tighter than PPO's: eps_low 0.2 / eps_high 0.28 are PPO-sized"),
    (dict(objective="gspo", eps_low=3e-4, eps_high=4e-4, tis_cap=2.0), "tis_mode must be sequence-mask"),
    (dict(objective="gspo", eps_low=3e-4, eps_high=4e-4, aggregation="token-sum"), "token-sum does not apply"),
    (dict(objective="grpo"), "objective must be one of ppo-clip, gspo, cispo, got 'grpo'"),
    (dict(tis_mode="token-mask"), "set tis_cap above 1"),
    (dict(tis_mode="mask", tis_cap=2.0), "tis_mode must be one of truncate, token-mask, sequence-mask"),
    (dict(aggregation="sum"), "aggregation must be token-mean, sequence-mean or token-sum, got 'sum'"),
])
def test_objective_settings_that_would_train_something_else_are_refused_in_one_line(policy, change, message):
    from configuration import check_config
    from retool import Config

    with pytest.raises(SystemExit) as e:
        check_config(Config(**change))
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=re.escape(message)):  # grpo_step refuses the same, in the same words
        sgd_step(policy, random_trajectories(1), **change)


def test_a_forced_wide_gspo_band_runs_and_the_loop_refuses_it_before_loading_anything(policy, tmp_path):
    import retool

    _, metrics = sgd_step(policy, random_trajectories(2), objective="gspo", force_gspo_clip=True)
    assert math.isfinite(metrics["loss"])
    with pytest.raises(SystemExit, match="--force-gspo-clip true"):
        retool.main(["--objective", "gspo", "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
    args, overrides = retool.parse_args(["--objective", "cispo", "--tis-mode", "sequence-mask", "--tis-cap", "2"])
    grpo_cfg = retool.grpo_config(retool.make_config(args.preset, overrides))
    assert (grpo_cfg.objective, grpo_cfg.tis_mode, grpo_cfg.tis_cap) == ("cispo", "sequence-mask", 2.0)


@pytest.mark.vllm
def test_each_new_objective_and_mask_runs_real_steps_with_finite_metrics(tiny_llm, sandbox, tiny_model_path, policy):
    """One real step each (vLLM, sandbox, reward, update, sync): gspo + sequence-mask, cispo + token-mask
    (the 3-step runs with the loop are measured in docs/06-beyond-torl.md). The forced turns make the mismatch
    real: on a forced token vLLM records the log-prob of the regex-constrained distribution, higher than the
    trainer's, so the masks have something to do."""
    from retool import Config, train_step
    from rollout import RolloutConfig

    settings = [dict(objective="gspo", eps_low=3e-4, eps_high=4e-4, tis_cap=2.0, tis_mode="sequence-mask"),
                dict(objective="cispo", tis_cap=2.0, tis_mode="token-mask")]
    rollout_cfg = RolloutConfig(group_size=4, tool_budget=1, max_response_tokens=32, seed=5,
                                force_turns=(f"({CODE_TURN}|{ANSWER_TURN})", ANSWER_TURN))
    problems = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    version = tiny_llm.weight_version = getattr(tiny_llm, "weight_version", 0)
    masked = []
    try:
        for change in settings:
            # every row runs: the random model's groups are often all wrong, and a skipped row has no metrics
            grpo_cfg = GRPOConfig(lr=1e-3, num_minibatches=2, micro_batch_size=4, max_response_tokens=32,
                                  skip_zero_advantage=False, **change)
            cfg = Config(group_size=4, problems_per_step=2, max_response_tokens=32, **change)
            metrics, _ = train_step(tiny_llm, policy, make_optimizer(policy, grpo_cfg), problems, sandbox,
                                    rollout_cfg, grpo_cfg, cfg)
            for key in ("entropy", "loss", "grad_norm", "clip_low_frac", "clip_high_frac", "tis_weight_mean",
                        "tis_masked_frac", "tis_masked_seq_frac"):
                assert math.isfinite(metrics[key]), (change, key)
            assert metrics["entropy"] > 0 and 0 <= metrics["tis_masked_frac"] <= 1
            masked.append(metrics["tis_masked_frac"])
    finally:  # the engine is shared by the whole session: put the original weights back
        sync_weights(load_policy(tiny_model_path, device="cpu"), tiny_llm)
        tiny_llm.weight_version = version
    assert masked[1] > 0  # forced tokens out of [1/2, 2] under token-mask


def test_the_ablations_figures_read_a_step_that_ran_no_row_as_nan():
    """A step whose groups are all degenerate logs entropy as null (no forward ran for it): NaN, not a crash."""
    from ablation import ARMS, figures

    row = {"reward_mean": 1.0, "rollout_s": 1.0, "reward_s": 0.0, "update_s": 0.0, "sync_s": 0.0, "ratio_max": 1.0,
           "clip_low_frac": 0.0, "clip_high_frac": 0.0, "entropy": 0.5, **dict.fromkeys(ARMS["baseline"][3], 1.0)}
    rows = [dict(row, step=step, entropy=None if step == 3 else 0.5) for step in (1, 2, 3)]
    evals = [{"tag": tag, "sets": {"all": {"avg@1": 0.5}}} for tag in ("before RL", "after RL")]
    out = figures({("baseline", 0): (rows, evals)})
    assert math.isnan(out["baseline_s0_entropy_step3"]) and out["baseline_s0_entropy_mean"] == 0.5


def test_every_ablation_arm_is_a_configuration_the_loop_accepts():
    """An arm the loop would refuse (a GSPO band left PPO-sized, a mask without a band) fails here, not hours in."""
    from ablation import ARMS
    from configuration import config_problems
    from retool import make_config, parse_args

    for arm, (flags, *_) in ARMS.items():
        args, overrides = parse_args(flags)
        assert config_problems(make_config(args.preset, overrides)) == [], arm
