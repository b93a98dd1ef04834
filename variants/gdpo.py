"""GDPO (arXiv 2601.05242; TRL's multi_objective_aggregation="normalize_then_sum"):
--reward-aggregation normalize_then_sum.

The default (advantage.py) sums the rewards, then z-scores the sum in its group:
rewards of different scales then collapse distinct combinations onto one
advantage. GDPO z-scores each function in its group before the weighted sum, and
z-scores that sum over the whole batch. Per row i in group g, function f of
weight w_f:

    Z_if = (R_if - mean_g(R_f)) / (std_g(R_f) + eps)   NaN entries skipped
    s_i  = sum_f w_f * Z_if
    A_i  = (s_i - mean(s)) / (std(s) + eps)            over the batch

--scale-rewards has no say here (config.py refuses batch and none). A group has
no signal when every function of non-zero weight is flat in it
(no_signal_groups): its equal totals can still hide a ranking GDPO sees.
advantage.compute_advantages imports this file only for normalize_then_sum; its
stats stay the weighted totals'.

Tests: python -m pytest -q tests/test_advantage.py tests/test_reward_aggregation.py
"""
import torch

from advantage import zero_spread


def no_signal_groups(rewards, weights, G):
    """rewards (N, F) with NaN for None, weights (F,) -> (N/G,) bool: the groups
    where every function of non-zero weight has one value (or none). GDPO's
    advantages are all 0 there.

    Its totals can be equal while the functions differ: GDPO still ranks those
    completions (1 * [1, 0] + 0.5 * [0, 2] totals [1, 1]).
    """
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    flat = torch.stack([zero_spread(rewards[:, f], G) for f in range(rewards.shape[1])],
                       dim=1)  # (N/G, F)
    return (flat | (weights == 0)).all(dim=1)  # (N/G,)


def normalize_then_sum(rewards, weights, G, eps=1e-4):
    """GDPO's advantages (arXiv 2601.05242; TRL's multi_objective_aggregation).

    rewards (N, F) with NaN for None, weights (F,) -> advantages (N,). Each
    function is z-scored within its group of G, then the weighted sum over the
    whole batch (under data parallelism: all ranks', the caller gathers them):

        Z_if = (R_if - mean_g(R_f)) / (std_g(R_f) + eps)   NaN entries skipped
        s_i  = sum_f w_f * Z_if                            (nansum)
        A_i  = (s_i - mean(s)) / (std(s) + eps)            over the batch

    std is the unbiased one, over the valid entries. As in TRL:
    - a function with fewer than two valid rewards in a group adds nothing there
      (TRL: its std is NaN, and nansum skips it);
    - a row where every function said None has no s_i: it is left out of the
      batch's mean and std, and gets A_i = 0.
    Unlike TRL, a function whose valid rewards in a group are all equal has
    Z_if = 0 exactly, and a group with no signal (no_signal_groups) has A_i = 0
    exactly (advantage.py's simplification 2). TRL leaves rounding noise
    there: (R - mean) / (0 + eps) is up to ~1e-4 when the mean is off by one ulp.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (N, F) = (completions, reward functions), "
                         f"got shape {tuple(rewards.shape)}")
    N, F = rewards.shape
    if G < 2 or N % G != 0:
        raise ValueError(f"{N} rewards do not split into groups of G={G} completions per "
                         f"prompt (need G >= 2 and N a multiple of G)")
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (F,):
        raise ValueError(f"weights must have one entry per reward function "
                         f"({F}), got shape {tuple(weights.shape)}")

    # 1. Each function's z-score within its group, over its valid rewards
    grouped = rewards.view(-1, G, F)  # (N/G, G, F)
    valid = ~grouped.isnan()  # (N/G, G, F)
    count = valid.sum(dim=1, keepdim=True)  # (N/G, 1, F)
    mean = grouped.nansum(dim=1, keepdim=True) / count.clamp(min=1)  # (N/G, 1, F)
    centered = (grouped - mean).masked_fill(~valid, 0.0)  # (N/G, G, F)
    squares = centered.square().sum(dim=1, keepdim=True)  # (N/G, 1, F)
    variance = squares / (count - 1).clamp(min=1)  # (N/G, 1, F)
    z = centered / (variance.sqrt() + eps)  # (N/G, G, F)
    # fewer than two valid rewards, or all equal: no z-score (above)
    flat = torch.stack([zero_spread(rewards[:, f], G) for f in range(F)], dim=1)  # (N/G, F)
    z = z.masked_fill(flat.unsqueeze(1), 0.0).view(N, F)  # (N, F)

    # 2. The weighted sum (the masked z-scores are 0: nansum), and the rows no
    #    function scored, which have none
    unscorable = rewards.isnan().all(dim=1)  # (N,)
    s = (z * weights).sum(dim=1)  # (N,)

    # 3. Its z-score over the batch, over the rows that have one
    s_valid = s[~unscorable]  # (n,)
    if s_valid.numel() < 2:  # no spread to divide by (TRL: NaN, then 0)
        return torch.zeros_like(s)
    advantages = (s - s_valid.mean()) / (s_valid.std() + eps)  # (N,)

    # 4. No advantage without a reward, or without signal in the group
    no_signal = no_signal_groups(rewards, weights, G)  # (N/G,)
    advantages = advantages.masked_fill(unscorable, 0.0).view(-1, G)  # (N/G, G)
    return advantages.masked_fill(no_signal.unsqueeze(1), 0.0).view(N)  # (N,)
