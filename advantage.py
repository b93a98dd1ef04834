"""Group-relative advantages: the group z-score.

The advantages are how GRPO replaces PPO's value network.

    compute_advantages(rewards, weights, G, ...)  the group z-score of each row's reward

The N rows of rewards are N/G groups of G consecutive completions of the same
prompt. There are F reward functions, of weights w_f. reward.py gives NaN where a
function had no opinion. Per row i in group g:
    r_i = sum_f w_f * R_if                  (NaN entries skipped)
    A_i = (r_i - mean_g(r)) / (std + eps)   (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2)
where std is
    "group": the std of r within group g (GRPO)
    "batch": the std of r over the whole batch
             (Lite PPO, arXiv 2508.08221; huggingface/trl#3938)
    "none" : no division, std + eps := 1 (Dr. GRPO, arXiv 2503.20783: the division
             up-weights questions that are too easy or too hard)
Every token of completion i shares A_i (loss.py broadcasts it over the tokens).

Variants, each in its own file (variants/), imported only with its flag:
    variants/gdpo.py              --reward-aggregation normalize_then_sum (GDPO):
                                  each reward z-scored in its group before the sum
    variants/dynamic_sampling.py  --dynamic-sampling N (DAPO): drop the groups with
                                  no signal (no_signal_groups), draw more rounds

Run the tests: python -m pytest -q tests/test_advantage.py

Simplifications:
1. A row where every function returned None has no reward. It is left out of its
   group's mean and std, and gets advantage 0 (no gradient from it).
2. A group whose rewards are all equal carries no signal: its advantages are set
   to exactly 0. r - mean is not exactly 0 in floating point: in fp32 the mean of
   seven 0.1s is not 0.1.
3. std is the unbiased one (n - 1), as torch.std and TRL. A group needs G >= 2.
4. Under data parallelism the caller gathers the whole batch first, so groups and
   the batch std are complete.
"""
import torch

from config import REWARD_AGGREGATIONS, SCALE_REWARDS


def total_rewards(rewards, weights):
    """rewards (N, F) with NaN for None, weights (F,) -> r (N,) = sum_f w_f * R_if.

    r is NaN where every function said None.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (N, F) = (completions, reward functions), "
                         f"got shape {tuple(rewards.shape)}")

    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (rewards.shape[1],):
        raise ValueError(f"weights must have one entry per reward function "
                         f"({rewards.shape[1]}), got shape {tuple(weights.shape)}")

    no_reward = rewards.isnan().all(dim=1)  # (N,)
    total = (rewards * weights).nansum(dim=1)  # (N,)
    return total.masked_fill(no_reward, float("nan"))  # (N,)


def zero_spread(r, G):
    """r (N,) -> (N/G,) bool: the groups whose valid rewards are all equal.

    A group with no valid reward counts too. max <= min is compared exactly. These
    groups carry no signal (simplification 2): --dynamic-sampling drops them
    (variants/dynamic_sampling.py).
    """
    grouped = r.view(-1, G)  # (N/G, G)
    valid = ~grouped.isnan()  # (N/G, G)

    highest = grouped.masked_fill(~valid, -torch.inf).amax(1)  # (N/G,)
    lowest = grouped.masked_fill(~valid, torch.inf).amin(1)  # (N/G,)
    return highest <= lowest


def no_signal_groups(rewards, weights, G, aggregation="sum_then_normalize"):
    """rewards (N, F) with NaN for None, weights (F,) -> (N/G,) bool: the groups
    whose advantages are all 0 under that aggregation.

    sum_then_normalize: the weighted totals are all equal (zero_spread).
    normalize_then_sum: GDPO's rule (variants/gdpo.py's no_signal_groups).
    """
    if aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: choose one of {REWARD_AGGREGATIONS}")
    if aggregation == "normalize_then_sum":
        from variants import gdpo

        return gdpo.no_signal_groups(rewards, weights, G)
    return zero_spread(total_rewards(rewards, weights), G)


def compute_advantages(rewards, weights, G, scale_rewards="group", eps=1e-4,
                       aggregation="sum_then_normalize"):
    """rewards (N, F) with NaN for None, weights (F,) -> (advantages (N,), stats).

    aggregation "normalize_then_sum" takes GDPO's (variants/gdpo.py), where
    scale_rewards must stay "group" (it has no say there). stats is a dict of
    floats, from the weighted totals whichever the aggregation.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: "
                         f"choose one of {SCALE_REWARDS}")
    if aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: choose one of {REWARD_AGGREGATIONS}")
    if aggregation == "normalize_then_sum" and scale_rewards != "group":
        raise ValueError(f"scale_rewards={scale_rewards!r} has no say with "
                         f"aggregation='normalize_then_sum' (its own batch z-score)")

    r = total_rewards(rewards, weights)  # (N,)
    N, F = rewards.shape
    if G < 2 or N % G != 0:
        raise ValueError(f"{N} rewards do not split into groups of G={G} completions per "
                         f"prompt (need G >= 2 and N a multiple of G)")

    # 1. Center each group on the mean of its valid rewards
    grouped = r.view(-1, G)  # (N/G, G)
    valid = ~grouped.isnan()  # (N/G, G)
    count = valid.sum(dim=1, keepdim=True)  # (N/G, 1)
    mean = grouped.nansum(dim=1, keepdim=True) / count.clamp(min=1)  # (N/G, 1)
    centered = (grouped - mean).masked_fill(~valid, 0.0)  # (N/G, G)

    # 2. The unbiased std of each group
    squares = centered.square().sum(dim=1, keepdim=True)  # (N/G, 1)
    variance = squares / (count - 1).clamp(min=1)  # (N/G, 1)
    group_std = variance.sqrt()  # (N/G, 1)
    no_signal = no_signal_groups(rewards, weights, G, aggregation)  # (N/G,)

    # 3. Scale, and zero the groups with no signal (GDPO: each reward first)
    if aggregation == "normalize_then_sum":
        from variants import gdpo

        advantages = gdpo.normalize_then_sum(rewards, weights, G, eps).view(-1, G)  # (N/G, G)
    elif scale_rewards == "group":
        advantages = centered / (group_std + eps)
    elif scale_rewards == "batch":
        r_valid = r[~r.isnan()]  # (n,)
        if r_valid.numel() > 1:
            batch_std = r_valid.std()
        else:
            batch_std = r.new_zeros(())
        advantages = centered / (batch_std + eps)
    else:
        advantages = centered
    advantages = advantages.masked_fill(no_signal.unsqueeze(1), 0.0).view(N)  # (N,)

    # 4. The stats
    has_reward = count.squeeze(1) > 0  # (N/G,)
    reward_mean = r.nanmean().item()
    # TRL's reward_std: the mean within-group std, how much learning signal there is
    if has_reward.any():
        reward_std = group_std.squeeze(1)[has_reward].mean().item()
    else:
        reward_std = float("nan")
    stats = {"reward_mean": reward_mean,
             "reward_std": reward_std,
             "frac_zero_std_groups": no_signal.float().mean().item()}
    for f in range(F):
        stats[f"reward/{f}"] = rewards[:, f].nanmean().item()

    return advantages, stats
