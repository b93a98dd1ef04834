"""advantage.py: advantages by hand, their invariances, None handling, input errors.

And GDPO's normalize_then_sum against a plain loop written from TRL 1.16's
formula (grpo_trainer.py, multi_objective_aggregation). Its flags and a run:
tests/test_reward_aggregation.py.
"""
import math

import pytest
import torch

from advantage import compute_advantages, no_signal_groups
from variants.gdpo import normalize_then_sum

nan = float("nan")


def test_group_advantages_by_hand():
    # two groups of G=2: rewards (1, 0) -> mean 0.5, unbiased std sqrt(0.5);
    # (3, 3) -> no signal
    rewards = torch.tensor([[1.0], [0.0], [3.0], [3.0]])
    adv, stats = compute_advantages(rewards, [1.0], G=2, eps=0.0)

    a = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]))
    assert stats["reward_mean"] == pytest.approx(7 / 4)
    # the mean of the group stds
    assert stats["reward_std"] == pytest.approx(math.sqrt(0.5) / 2)
    assert stats["frac_zero_std_groups"] == 0.5
    assert stats["reward/0"] == pytest.approx(7 / 4)


def test_weighted_functions_and_scalings_by_hand():
    # r = 1 * accuracy + 0.5 * format = (1.5, 0.5, 1.0, 0.0) for two groups of 2
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    weights = torch.tensor([1.0, 0.5])
    adv, stats = compute_advantages(rewards, weights, G=2, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, -0.5]))
    assert stats["reward/0"] == 0.5
    assert stats["reward/1"] == 0.5

    batch_std = torch.tensor([1.5, 0.5, 1.0, 0.0]).std().item()  # sqrt(5/12)
    assert batch_std == pytest.approx(math.sqrt(5 / 12))
    adv, _ = compute_advantages(rewards, weights, G=2, scale_rewards="batch", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, -0.5]) / batch_std)


def test_equal_rewards_give_exactly_zero():
    # in fp32 the mean of seven 0.1s is not 0.1; the advantage must still be exactly 0
    rewards = torch.full((7, 1), 0.1)

    for scale in ("group", "batch", "none"):
        adv, stats = compute_advantages(rewards, [1.0], G=7, scale_rewards=scale)
        assert torch.equal(adv, torch.zeros(7))
        assert stats["frac_zero_std_groups"] == 1.0


def test_none_rewards_are_skipped():
    # row 1: accuracy had no opinion, format counts; row 3: no function had an opinion
    rewards = torch.tensor([[1.0, 0.0], [nan, 1.0], [0.0, 0.0], [nan, nan]])
    adv, stats = compute_advantages(rewards, [1.0, 1.0], G=4, scale_rewards="none")

    # r = (1, 1, 0, none): mean over the 3 rewarded rows is 2/3; the unrewarded row gets 0
    torch.testing.assert_close(adv, torch.tensor([1 / 3, 1 / 3, -2 / 3, 0.0]))
    assert stats["reward/0"] == 0.5
    assert stats["reward/1"] == pytest.approx(1 / 3)
    assert stats["reward_mean"] == pytest.approx(2 / 3)

    # a group with no rewards at all is a zero-signal group, not NaN
    adv, stats = compute_advantages(torch.full((4, 1), nan), [1.0], G=2)
    assert torch.equal(adv, torch.zeros(4))
    assert stats["frac_zero_std_groups"] == 1.0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_properties(scale):
    torch.manual_seed(0)
    G = 8
    rewards = torch.randn(5 * G, 3, dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)

    adv, _ = compute_advantages(rewards, weights, G, scale)
    assert torch.isfinite(adv).all()
    # each group sums to 0
    zeros = torch.zeros(5, dtype=torch.float64)
    torch.testing.assert_close(adv.view(-1, G).sum(1), zeros)

    # a constant added to one group's rewards leaves every advantage unchanged
    shifted = rewards.clone()
    shifted[2 * G:3 * G, 0] += 7.0
    adv_shift, _ = compute_advantages(shifted, weights, G, scale)
    # (with "batch" the shift changes the batch std, and so every advantage)
    if scale != "batch":
        torch.testing.assert_close(adv_shift, adv)


def test_scaling_rewards_leaves_group_advantages_unchanged():
    torch.manual_seed(1)
    rewards = torch.rand(12, 2, dtype=torch.float64)
    adv, _ = compute_advantages(rewards, [1.0, 1.0], 4, "group", eps=0.0)

    for scale in (3.0, 100.0):
        scaled = scale * rewards
        adv_scaled, _ = compute_advantages(scaled, [1.0, 1.0], 4, "group", eps=0.0)
        torch.testing.assert_close(adv_scaled, adv)

    # with "group" each group's advantages have unbiased std 1 (eps=0)
    torch.testing.assert_close(adv.view(3, 4).std(1), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(6, 1), [1.0], 4), "groups of G=4"),
    ((torch.zeros(6, 1), [1.0], 1), "G >= 2"),
    ((torch.zeros(6), [1.0], 2), r"\(N, F\)"),
    ((torch.zeros(6, 2), [1.0], 2), "one entry per reward function"),
])
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(*args)

    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(torch.zeros(4, 1), [1.0], 2, scale_rewards=True)


# ---- GDPO: normalize_then_sum --------------------------------------------------

def trl_normalize_then_sum(rewards, weights, G, eps=1e-4):
    """TRL's multi_objective_aggregation="normalize_then_sum", one number at a time.

    rewards: rows of F floats (nan for None) -> one advantage per row.
    """
    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):  # unbiased; nan below two values (TRL's nanstd)
        if len(xs) < 2:
            return nan
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    N, F = len(rewards), len(weights)
    s = []
    for i in range(N):
        group = rewards[i // G * G:(i // G + 1) * G]
        if all(math.isnan(x) for x in rewards[i]):
            s.append(nan)  # unscorable
            continue
        total = 0.0
        for f in range(F):
            values = [row[f] for row in group if not math.isnan(row[f])]
            z = nan
            if values and not math.isnan(rewards[i][f]):
                z = (rewards[i][f] - mean(values)) / (std(values) + eps)
            if not math.isnan(z * weights[f]):  # nansum
                total += z * weights[f]
        s.append(total)

    scored = [x for x in s if not math.isnan(x)]
    advantages = []
    for x in s:
        a = (x - mean(scored)) / (std(scored) + eps) if scored else nan
        advantages.append(0.0 if math.isnan(a) else a)  # nan_to_num
    return advantages


def test_normalize_then_sum_equals_trls_formula_with_none_rewards():
    """Random rewards of 3 functions, G = 4, some None, unequal weights.

    One row no function scored; one function with one valid reward in a group
    (no std: it adds nothing there); a function None in a whole group.
    """
    torch.manual_seed(0)
    G = 4
    rewards = torch.rand(6 * G, 3, dtype=torch.float64)
    rewards[torch.rand(6 * G, 3) < 0.2] = nan
    rewards[5] = nan  # unscorable
    rewards[8:12, 1] = torch.tensor([0.7, nan, nan, nan], dtype=torch.float64)
    rewards[12:16, 2] = nan
    weights = [1.0, 0.5, 2.0]

    adv = normalize_then_sum(rewards, weights, G)
    expected = trl_normalize_then_sum(rewards.tolist(), weights, G)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))
    assert adv[5] == 0.0
    # the same through compute_advantages
    adv2, _ = compute_advantages(rewards, weights, G, aggregation="normalize_then_sum")
    assert torch.equal(adv2, adv)


def test_normalize_then_sum_by_hand_ranks_what_sum_then_normalize_cannot():
    """f1 = (1, 0), f2 = (0, 2), w = (1, 0.5): both totals are 1.

    sum_then_normalize sees no signal. GDPO (eps 0): z1 = (0.707, -0.707), z2 =
    (-0.707, 0.707), s = (0.354, -0.354), whose unbiased std is 0.5: A = (0.707,
    -0.707). The second group (f1 = 0, 1; f2 = 0, 0) only joins the batch std.
    """
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 0.0]])
    weights = [1.0, 0.5]

    adv, stats = compute_advantages(rewards, weights, 2, eps=0.0)
    assert torch.equal(adv[:2], torch.zeros(2)) and stats["frac_zero_std_groups"] == 0.5

    adv, stats = compute_advantages(rewards, weights, 2, eps=0.0,
                                    aggregation="normalize_then_sum")
    a = 1 / math.sqrt(2)
    s = torch.tensor([a / 2, -a / 2, -a, a])  # the weighted sums of z-scores
    torch.testing.assert_close(adv, s / s.std())
    assert stats["frac_zero_std_groups"] == 0.0
    # the other stats are of the weighted totals, whichever the aggregation
    _, plain = compute_advantages(rewards, weights, 2, eps=0.0)
    assert {k: v for k, v in stats.items() if k != "frac_zero_std_groups"} == \
        {k: v for k, v in plain.items() if k != "frac_zero_std_groups"}

    assert no_signal_groups(rewards, weights, 2).tolist() == [True, False]
    assert no_signal_groups(rewards, weights, 2, "normalize_then_sum").tolist() == [False, False]
    # a function of weight 0 has no say
    assert no_signal_groups(rewards, [0.0, 1.0], 2, "normalize_then_sum").tolist() == [False, True]


def test_normalize_then_sum_ignores_each_rewards_scale():
    """Scaling one function by a positive constant changes no advantage (eps 0).

    sum_then_normalize changes: the scaled function outweighs the others.
    """
    torch.manual_seed(1)
    rewards = torch.rand(5 * 4, 2, dtype=torch.float64)
    scaled = rewards * torch.tensor([100.0, 1.0], dtype=torch.float64)

    adv = normalize_then_sum(rewards, [1.0, 1.0], 4, eps=0.0)
    torch.testing.assert_close(normalize_then_sum(scaled, [1.0, 1.0], 4, eps=0.0), adv)
    # over the batch: mean 0 and unbiased std 1
    torch.testing.assert_close(adv.mean(), torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(adv.std(), torch.tensor(1.0, dtype=torch.float64))

    plain, _ = compute_advantages(rewards, [1.0, 1.0], 4)
    plain_scaled, _ = compute_advantages(scaled, [1.0, 1.0], 4)
    assert not torch.allclose(plain, plain_scaled)


def test_normalize_then_sum_no_signal_is_exactly_zero():
    """A group whose every function has one value gets exactly 0.

    TRL leaves rounding noise there: the fp32 mean of seven 0.1s is not 0.1.
    """
    rewards = torch.rand(3 * 7, 2)
    rewards[7:14] = torch.tensor([0.1, 0.3])
    adv, stats = compute_advantages(rewards, [1.0, 1.0], 7, aggregation="normalize_then_sum")

    assert torch.equal(adv[7:14], torch.zeros(7)) and adv[:7].abs().min() > 0
    assert stats["frac_zero_std_groups"] == pytest.approx(1 / 3)
    # all None, or a single scored row: no batch spread, all 0 (TRL: nan -> 0)
    assert torch.equal(normalize_then_sum(torch.full((4, 1), nan), [1.0], 2), torch.zeros(4))
    one = torch.tensor([[1.0], [nan], [nan], [nan]])
    assert torch.equal(normalize_then_sum(one, [1.0], 2), torch.zeros(4))


def test_normalize_then_sum_errors():
    with pytest.raises(ValueError, match="scale_rewards='batch' has no say"):
        compute_advantages(torch.zeros(4, 1), [1.0], 2, scale_rewards="batch",
                           aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="aggregation='mean'"):
        compute_advantages(torch.zeros(4, 1), [1.0], 2, aggregation="mean")
    with pytest.raises(ValueError, match="groups of G=4"):
        normalize_then_sum(torch.zeros(6, 1), [1.0], 4)
    with pytest.raises(ValueError, match="one entry per reward function"):
        normalize_then_sum(torch.zeros(6, 2), [1.0], 2)
