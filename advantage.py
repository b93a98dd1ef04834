"""Group-relative advantages: how GRPO replaces PPO's value network.

The N rows of rewards are N/G groups of G consecutive completions of the same prompt. Per row i
in group g, with F reward functions of weights w_f (reward.py gives NaN where a function had no
opinion):
    r_i = sum_f w_f * R_if                  (NaN entries skipped)
    A_i = (r_i - mean_g(r)) / (std + eps)   (DeepSeekMath, arXiv 2402.03300, sec. 4.1.2)
where std is
    "group": the std of r within group g (GRPO)
    "batch": the std of r over the whole batch (Lite PPO, arXiv 2508.08221; TRL PR 3938)
    "none" : no division, std + eps := 1 (Dr. GRPO, arXiv 2503.20783: the division up-weights
             questions that are too easy or too hard)
Every token of completion i shares A_i (loss.py broadcasts it over the tokens).

Run the tests: python -m pytest -q tests/test_advantage.py

Simplifications:
1. A row where every function returned None has no reward: it is left out of its group's mean and
   std and gets advantage 0 (no gradient from it).
2. A group whose rewards are all equal carries no signal: its advantages are set to exactly 0
   (r - mean is not exactly 0 in floating point: in fp32 the mean of seven 0.1s is not 0.1).
3. std is the unbiased one (n - 1), as torch.std and TRL; a group needs G >= 2.
4. Under data parallelism the caller gathers the whole batch first, so groups and the batch std
   are complete.
"""
import torch

SCALE_REWARDS = ("group", "batch", "none")


def total_rewards(rewards, weights):
    """rewards (N, F) with NaN for None, weights (F,) -> r (N,) = sum_f w_f * R_if, NaN where every function said
    None."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (N, F) = (completions, reward functions), got shape {tuple(rewards.shape)}")
    weights = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (rewards.shape[1],):
        raise ValueError(f"weights must have one entry per reward function ({rewards.shape[1]}), got shape "
                         f"{tuple(weights.shape)}")
    no_reward = rewards.isnan().all(dim=1)  # (N,)
    return (rewards * weights).nansum(dim=1).masked_fill(no_reward, float("nan"))  # (N,)


def zero_spread(r, G):
    """r (N,) -> (N/G,) bool: groups whose valid rewards are all equal (or none valid), max <= min compared exactly.
    They carry no signal (simplification 2); train.py --dynamic-sampling drops them (common.dynamic_sampling)."""
    grouped = r.view(-1, G)  # (N/G, G)
    valid = ~grouped.isnan()  # (N/G, G)
    return grouped.masked_fill(~valid, -torch.inf).amax(1) <= grouped.masked_fill(~valid, torch.inf).amin(1)


def compute_advantages(rewards, weights, G, scale_rewards="group", eps=1e-4):
    """rewards (N, F) with NaN for None, weights (F,) -> (advantages (N,), stats dict of floats)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose one of {SCALE_REWARDS}")
    r = total_rewards(rewards, weights)  # (N,)
    N, F = rewards.shape
    if G < 2 or N % G != 0:
        raise ValueError(f"{N} rewards do not split into groups of G={G} completions per prompt "
                         f"(need G >= 2 and N a multiple of G)")
    grouped = r.view(-1, G)  # (N/G, G)
    valid = ~grouped.isnan()  # (N/G, G)
    count = valid.sum(dim=1, keepdim=True)  # (N/G, 1)
    mean = grouped.nansum(dim=1, keepdim=True) / count.clamp(min=1)  # (N/G, 1)
    centered = (grouped - mean).masked_fill(~valid, 0.0)  # (N/G, G)
    group_std = (centered.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # (N/G, 1)
    no_signal = zero_spread(r, G)  # (N/G,)

    if scale_rewards == "group":
        advantages = centered / (group_std + eps)
    elif scale_rewards == "batch":
        r_valid = r[~r.isnan()]  # (n,)
        batch_std = r_valid.std() if r_valid.numel() > 1 else r.new_zeros(())
        advantages = centered / (batch_std + eps)
    else:
        advantages = centered
    advantages = advantages.masked_fill(no_signal.unsqueeze(1), 0.0).view(N)  # (N,)

    has_reward = count.squeeze(1) > 0  # (N/G,)
    stats = {"reward_mean": r.nanmean().item(),
             # TRL's reward_std: the mean within-group std, i.e. how much learning signal there is
             "reward_std": group_std.squeeze(1)[has_reward].mean().item() if has_reward.any() else float("nan"),
             "frac_zero_std_groups": no_signal.float().mean().item()}
    for f in range(F):
        stats[f"reward/{f}"] = rewards[:, f].nanmean().item()
    return advantages, stats
