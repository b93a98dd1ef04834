"""Group-relative advantages and DAPO's dynamic sampling.

The advantages are how GRPO replaces PPO's value network.

    compute_advantages(rewards, weights, G, ...)  the group z-score of each row's reward
    normalize_then_sum(rewards, weights, G)       GDPO's: each reward's, then the batch's
    dynamic_sampling(rounds, max_rounds, ...)     drop no-signal groups, draw more rounds

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

That is "sum_then_normalize" (--reward-aggregation, the default). GDPO (arXiv
2601.05242, --reward-aggregation normalize_then_sum) z-scores each function in
its group before the sum, so that rewards of different scales do not collapse
distinct combinations onto one advantage; the sum is then z-scored over the
batch (normalize_then_sum's docstring). --scale-rewards has no say there.

DAPO's dynamic sampling (train.py --dynamic-sampling, arXiv 2503.14476) drops the
groups whose rewards are all equal (no_signal_groups). Those have zero spread:
advantage 0, no gradient. It draws more rounds of prompts until each rank holds
its share of --prompts-per-step informative groups (see dynamic_sampling's
docstring). With GDPO it keeps the groups GDPO can rank (no_signal_groups).

Run the tests: python -m pytest -q tests/test_advantage.py tests/test_dynamic_sampling.py

Simplifications:
1. A row where every function returned None has no reward. It is left out of its
   group's mean and std, and gets advantage 0 (no gradient from it).
2. A group whose rewards are all equal carries no signal: its advantages are set
   to exactly 0. r - mean is not exactly 0 in floating point: in fp32 the mean of
   seven 0.1s is not 0.1. With normalize_then_sum "all equal" is per function:
   a group where every weighed function has one value (no_signal_groups).
3. std is the unbiased one (n - 1), as torch.std and TRL. A group needs G >= 2.
4. Under data parallelism the caller gathers the whole batch first, so groups and
   the batch std are complete.
"""
import dataclasses

import torch
import torch.distributed as dist

from common import all_ranks_ok, collective_device, ddp, world
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
    groups carry no signal (simplification 2): train.py --dynamic-sampling drops
    them (dynamic_sampling below).
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
    normalize_then_sum: each function of non-zero weight has one value in the
    group (or none). Its totals can be equal while the functions differ: GDPO
    still ranks those completions (1 * [1, 0] + 0.5 * [0, 2] totals [1, 1]).
    """
    if aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: choose one of {REWARD_AGGREGATIONS}")
    if aggregation == "sum_then_normalize":
        return zero_spread(total_rewards(rewards, weights), G)

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
    exactly (simplification 2). TRL leaves rounding noise there: (R - mean) /
    (0 + eps) is up to ~1e-4 when the mean is off by one ulp.
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
    no_signal = no_signal_groups(rewards, weights, G, "normalize_then_sum")  # (N/G,)
    advantages = advantages.masked_fill(unscorable, 0.0).view(-1, G)  # (N/G, G)
    return advantages.masked_fill(no_signal.unsqueeze(1), 0.0).view(N)  # (N,)


def compute_advantages(rewards, weights, G, scale_rewards="group", eps=1e-4,
                       aggregation="sum_then_normalize"):
    """rewards (N, F) with NaN for None, weights (F,) -> (advantages (N,), stats).

    aggregation "normalize_then_sum" takes GDPO's (normalize_then_sum), where
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
        advantages = normalize_then_sum(rewards, weights, G, eps).view(-1, G)  # (N/G, G)
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


def dynamic_sampling(rounds, max_rounds, G, weights, pad_id, aggregation="sum_then_normalize"):
    """DAPO's dynamic sampling (arXiv 2503.14476, sec. 3.2).

    It is called after each round of a step's rollouts. A group whose G weighted
    total rewards are all equal (GDPO: each function's) has advantage 0 and no
    gradient, so it is dropped.
    More rounds of prompts are drawn until this rank holds its quota of the other
    groups. The quota is this rank's share of --prompts-per-step.

    rounds: this rank's rounds so far, [(rows, Rollout, rewards (quota*G, F))].
    max_rounds: the bound (0: off). aggregation: which groups have no signal
    (no_signal_groups: with GDPO's, equal totals can still rank completions).
    Returns None when another round is due, on every rank alike. Otherwise it
    returns ((rows, Rollout, rewards) of quota groups, the step's metrics). The
    metrics are the rounds drawn, the groups generated and the informative groups
    kept, over all ranks; {} when off.

    1. Each rank fills its own quota from its own rounds. The G completions of a
       prompt never leave their rank, and every rank ends with quota groups. The
       shapes stay static: the rewards all-gather and DDP stay matched.
    2. A round is drawn on every rank while any rank is short (a MIN all-reduce).
       So a rank that is full still samples a round, and wastes it: the engines'
       call numbers and the prompt stream stay in step on every rank.
    3. At the bound, a rank still short tops up with zero-spread groups of its last
       round. They add no gradient: the step trains on what there is, and
       ds_groups_informative < --prompts-per-step says so.
    4. Informative groups beyond the quota are dropped, not kept for the next step.
       There they would be off-policy, and a checkpoint would have to hold them.
    """
    if max_rounds == 0:
        return rounds[0], {}

    quota = len(rounds[0][0]) // G
    # per round, (quota,) bool: its groups with zero spread
    no_signal = [no_signal_groups(part[2], weights, G, aggregation) for part in rounds]
    # (round, group index) of every informative group, in the order drawn
    informative = []
    for part, flat in zip(rounds, no_signal):
        for g in (~flat).nonzero().flatten().tolist():
            informative.append((part, g))

    if len(rounds) < max_rounds and not all_ranks_ok(len(informative) >= quota):
        return None

    # point 3: what a rank still short at the bound tops up with
    top_up = [(rounds[-1], g) for g in no_signal[-1].nonzero().flatten().tolist()]

    if ddp:
        device = collective_device()
    else:
        device = "cpu"
    kept = torch.tensor([min(len(informative), quota)], device=device)
    if ddp:
        dist.all_reduce(kept)

    batch = take_groups((informative + top_up)[:quota], G, pad_id)
    metrics = dict(ds_rounds=len(rounds),
                   ds_groups_generated=len(rounds) * quota * world,
                   ds_groups_informative=int(kept))
    return batch, metrics


def take_groups(picks, G, pad_id):
    """[((rows, Rollout, rewards), group index)] -> (rows, Rollout, rewards).

    The result holds those groups, in that order. Rounds differ in their longest
    completion: the (N, T) tensors are right-padded to the longest (pad id, mask 0).
    """
    T = max(part[1].completion_ids.shape[1] for part, _ in picks)

    rows = []
    rewards = []
    fields = {}
    for (part_rows, rollout, part_rewards), g in picks:
        s = slice(g * G, (g + 1) * G)  # the group's G completions
        rows += part_rows[s]
        rewards.append(part_rewards[s])  # (G, F)

        for f in dataclasses.fields(rollout):
            x = getattr(rollout, f.name)[s]
            # a (G, T of its round) tensor -> (G, T)
            if isinstance(x, torch.Tensor) and x.dim() == 2:
                pad = pad_id if f.name == "completion_ids" else 0
                x = torch.nn.functional.pad(x, (0, T - x.shape[1]), value=pad)  # (G, T)
            fields.setdefault(f.name, []).append(x)

    joined = {}
    for name, parts in fields.items():
        if isinstance(parts[0], torch.Tensor):
            joined[name] = torch.cat(parts)
        else:
            joined[name] = sum(parts, [])

    return rows, type(rollout)(**joined), torch.cat(rewards)  # (N,), Rollout of N, (N, F)
