"""The GRPO update's contract, one rule per test (tiny model, CPU, float32)."""
import copy
import math

import pytest
import torch

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

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    policy.lm_head.register_forward_hook(keep_logits)
    trajectories = random_trajectories(3)
    batch = build_batch(trajectories)
    logprobs = token_logprobs(policy, batch)
    loss, _ = clipped_policy_loss(logprobs, logprobs.detach(), batch.advantages, batch.loss_mask)
    loss.backward()

    grad = captured["logits"].grad  # [B, T, V]; position j predicts input j + 1
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


@pytest.mark.parametrize("sign", [+1.0, -1.0])
def test_one_step_moves_the_trajectory_logprob_the_way_of_its_advantage(policy, sign):
    trajectory = random_trajectories(1)[0]
    trajectory.advantage = sign
    before = summed_logprob(policy, trajectory)
    cfg = GRPOConfig(lr=1e-4, num_minibatches=1)
    grpo_step(policy, make_optimizer(policy, cfg), [trajectory], cfg)
    after = summed_logprob(policy, trajectory)
    assert (after - before) * sign > 0.01


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_micro_batch_size_does_not_change_the_update(policy, aggregation):
    trajectories = random_trajectories(5)
    results = []
    for micro in (1, 2, 5):
        model = copy.deepcopy(policy)
        cfg = GRPOConfig(num_minibatches=1, micro_batch_size=micro, aggregation=aggregation, max_grad_norm=1e9)
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
                "sequences", "optimizer_steps", "skipped_steps"}
    assert expected <= set(metrics)
    assert all(type(k) is str and type(v) is float and math.isfinite(v) for k, v in metrics.items())
    assert metrics["tokens"] == sum(sum(t.loss_mask) for t in random_trajectories(3))


def test_bf16_master_weights_are_refused(policy):
    with pytest.raises(ValueError, match="float32"):
        make_optimizer(policy.to(torch.bfloat16), GRPOConfig())


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
