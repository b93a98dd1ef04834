"""--reward-aggregation normalize_then_sum (GDPO) from train.py's side.

Its rules (in-process, config.py); DAPO's dynamic sampling keeps the groups GDPO
can rank (in-process); and runs with two rewards whose weighted totals are all
equal (tests/equal_total_rewards.py): sum_then_normalize learns nothing from
them, GDPO logs exactly the advantages variants/gdpo.py's normalize_then_sum gives. The
math against TRL's formula: tests/test_advantage.py.
"""
import pytest
import torch

from config import check_flags
from helpers import parse_flags as parse
from helpers import assert_close_rel, fp32_tol, refused, run_train
from test_dynamic_sampling import PAD, groups_of, make_round
from variants.dynamic_sampling import dynamic_sampling
from variants.gdpo import normalize_then_sum

G = 8
PROMPTS = 4
FAST = ["--engine", "hf", "--steps", "2", "--eval-size", "8", "--eval-every", "0",
        "--prompts-per-step", str(PROMPTS), "--G", str(G),
        "--rewards", "equal_total_rewards.odd", "equal_total_rewards.even_double",
        "--reward-weights", "1", "0.5"]


@pytest.mark.parametrize("scale", ["batch", "none"])
def test_scale_rewards_is_refused_with_normalize_then_sum(scale, capsys):
    out = refused(["--reward-aggregation", "normalize_then_sum", "--scale-rewards", scale],
                  capsys)
    expected = f"--scale-rewards {scale} does nothing with --reward-aggregation"
    assert expected in out, out


def test_normalize_then_sum_is_accepted_with_dynamic_sampling():
    # no SystemExit
    check_flags(parse(["--reward-aggregation", "normalize_then_sum",
                       "--dynamic-sampling", "2"]))
    check_flags(parse(["--scale-rewards", "batch"]))


def test_dynamic_sampling_keeps_the_groups_gdpo_ranks():
    """Equal totals (1 x [1, 0] + 0.5 x [0, 2]) are no signal for the sum, but
    GDPO ranks them; a group whose every function is flat is dropped by both."""
    r1 = make_round(["a", "b"], [[1, 0], [0, 2], [1, 1], [1, 1]], 2, T=2)
    weights = [1.0, 0.5]

    # sum_then_normalize: no informative group, another round
    assert dynamic_sampling([r1], 2, 2, weights, PAD) is None

    # GDPO: a is informative, b (flat in both functions) is not
    assert dynamic_sampling([r1], 2, 2, weights, PAD, "normalize_then_sum") is None
    r2 = make_round(["c", "d"], [[0, 2], [1, 0], [0, 0], [0, 0]], 2, T=2)
    (_, rollout, _), stats = dynamic_sampling([r1, r2], 2, 2, weights, PAD,
                                              "normalize_then_sum")
    assert groups_of(rollout, 2) == ["a", "c"]
    assert stats["ds_groups_informative"] == 2


def expected_rewards():
    """The rewards of one step's PROMPTS * G completions: odd, even_double."""
    i = torch.arange(PROMPTS * G)
    return torch.stack([(i % 2).float(), 2.0 * (1 - i % 2).float()], dim=1)  # (N, 2)


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_a_run_with_equal_totals(aggregation, tmp_path):
    """--dynamic-sampling 2 too: the sum drops every group (and tops up at the
    bound), GDPO keeps them all in one round."""
    flags = ["--reward-aggregation", aggregation, "--dynamic-sampling", "2"]
    _, _, records = run_train(FAST + flags, tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]

    for r in records[1:]:
        assert r["reward_mean"] == pytest.approx(1.0)
        if aggregation == "sum_then_normalize":
            assert r["adv_abs_mean"] == 0.0 and r["frac_zero_std_groups"] == 1.0
            assert r["ds_rounds"] == 2 and r["ds_groups_informative"] == 0
        else:
            adv = normalize_then_sum(expected_rewards(), [1.0, 0.5], G)  # (N,)
            assert adv.abs().min() > 0.9
            # fp32 means over the step's N advantages: fp32_tol(N) of their magnitude
            tol, scale = fp32_tol(len(adv)), adv.abs().max().item()
            assert_close_rel(r["adv_abs_mean"], adv.abs().mean(), tol, scale=scale, msg="|adv|")
            assert_close_rel(r["adv_mean"], 0.0, tol, scale=scale, msg="adv_mean")
            assert r["frac_zero_std_groups"] == 0.0
            assert r["ds_rounds"] == 1 and r["ds_groups_informative"] == PROMPTS
