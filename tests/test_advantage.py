"""advantage.py: advantages by hand, their invariances, None handling, input errors."""
import math

import pytest
import torch

from advantage import compute_advantages

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
