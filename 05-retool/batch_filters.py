"""The loop's options from the field since ToRL: DAPO's dynamic sampling, and what leaves the loss.

Each is a Config field, off by default and in the torl-* presets (ToRL had none). Why: docs/06-beyond-torl.md.
"""
from __future__ import annotations

import dataclasses


def keep_informative_groups(trajectories, results, sample, rollout_cfg, more_problems, cfg):
    """DAPO's dynamic sampling, if on: (trajectories, results, metrics) with as many groups; extra round r samples
    `more_problems(r)` with `sample`, a seed of its own. Off: the step's own, no metrics."""
    from distributed import any_rank  # chapter 06's: whether this rank or any other says yes

    if not cfg.dynamic_sampling:
        return trajectories, results, {}

    def extra_groups(extra_round):
        extra_cfg = dataclasses.replace(rollout_cfg, seed=extra_seed(rollout_cfg.seed, extra_round))
        return groups_of(*sample(more_problems(extra_round), extra_cfg), cfg.group_size)

    groups, drawn, rounds = informative_groups(groups_of(trajectories, results, cfg.group_size), extra_groups,
                                               len(trajectories) // cfg.group_size, cfg.dynamic_sampling_rounds,
                                               any_rank)
    trajectories = [t for group in groups for t, _ in group]
    results = [r for group in groups for _, r in group]
    return trajectories, results, {"problems_drawn": float(drawn), "dynamic_rounds": float(rounds)}


def groups_of(trajectories, results, group_size: int) -> list[list[tuple]]:
    """(trajectory, reward result) pairs, one list per problem."""
    pairs = list(zip(trajectories, results))
    return [pairs[i: i + group_size] for i in range(0, len(pairs), group_size)]


def informative_groups(groups, more, want: int, max_rounds: int, any_rank=bool):
    """Keep groups whose rewards differ until `want` are held: (groups, problems drawn, extra rounds); `more(r)` gives
    round r's. At the bound degenerate groups fill the step in drawn order. Every rank runs the rounds any rank needs
    (`any_rank`), drawing none once it has its groups, so no rank waits in a collective on another's.

        rewards per group  [+1 +1] [-1 +1] [-1 -1]   want 2, more() gives [[+1 -1]]
        kept               [-1 +1] [+1 -1]           drawn 4 problems, 1 extra round
    """
    informative, degenerate, drawn, rounds = [], [], 0, 0
    while True:
        for group in groups:
            rewards = {t.reward for t, _ in group}
            (informative if len(rewards) > 1 else degenerate).append(group)
        drawn += len(groups)
        if rounds >= max_rounds or not any_rank(len(informative) < want):
            break
        rounds += 1
        groups = more(rounds) if len(informative) < want else []
    kept = informative[:want]
    return kept + degenerate[: want - len(kept)], drawn, rounds


def extra_seed(seed: int | None, extra_round: int) -> int | None:
    """A seed for an extra round that no step's own seed (seed * 100_003 + step) reuses in practice."""
    return None if seed is None else seed + extra_round * 1_000_000_007


def excluded_from_loss(trajectories, tokenizer, mask_truncated: bool, filter_void_turns: bool):
    """(one flag per trajectory: kept out of the loss, metrics); void turns are counted whether filtered or not."""
    has_void_turn = [void_turns(t, tokenizer) > 0 for t in trajectories]
    excluded = [(mask_truncated and t.truncated) or (filter_void_turns and void)
                for t, void in zip(trajectories, has_void_turn)]
    metrics = {}
    if mask_truncated:
        metrics["truncated_masked"] = float(sum(t.truncated for t in trajectories))
    if filter_void_turns:
        metrics["void_filtered"] = float(sum(has_void_turn))
    metrics["void_trajectories"] = float(sum(has_void_turn))
    return excluded, metrics


def void_turns(t, tokenizer) -> int:
    """Model turns that hold neither a complete ```python block nor a \\boxed{} answer (SimpleTIR's void turns)."""
    from reward import extract_last_boxed
    from rollout import STOP, extract_code

    bounds = [0] + [b for call in t.tool_calls for b in (call.start, call.end)] + [len(t.token_ids)]
    count = 0
    for turn, (start, end) in enumerate(zip(bounds[0::2], bounds[1::2])):
        if end <= start:
            continue  # the budget ended the trajectory inside an observation: no turn after it
        text = tokenizer.decode(t.token_ids[start:end], skip_special_tokens=True)
        if turn < len(t.tool_calls):
            # the code was looked for before the stop string, as the rollout did: its ``` is no fence
            text = text[: text.rfind(STOP)] if STOP in text else text
        if extract_code(text) is None and extract_last_boxed(text) is None:
            count += 1
    return count
