"""The unbiased pass@k estimator, runlog/pass_at_k.py.

It is Chen et al. 2021 (arXiv 2107.03374), eq. 1. It is checked against values
worked out by hand, and against the binomial form. The evaluation that uses it
(train.py --eval-samples) is tested end to end in tests/test_dynamic_sampling.py
(test_pass_at_k_of_known_rewards_over_prompts_and_ranks).
"""
import math

import pytest

from helpers import run_train, without_timings
from runlog.pass_at_k import pass_at_k

# (n, c, k, pass@k) worked out by hand: 1 - C(n-c, k) / C(n, k)
HAND = [
    (5, 0, 1, 0.0),  # nothing passed: 0 at every k
    (5, 0, 5, 0.0),
    (5, 5, 1, 1.0),  # everything passed: 1 at every k
    (5, 5, 5, 1.0),
    (10, 3, 1, 0.3),  # k = 1: the fraction that passed, c/n
    (10, 3, 2, 1 - 21 / 45),  # C(7, 2) = 21, C(10, 2) = 45
    (4, 1, 2, 0.5),  # C(3, 2) / C(4, 2) = 3/6
    (4, 1, 4, 1.0),  # n = k: 1 as soon as one passed ...
    (4, 0, 4, 0.0),  # ... and 0 when none did
    (8, 2, 7, 1.0),  # n - c < k: every 7 of the 8 hold a pass
    (8, 2, 6, 1 - 1 / 28),  # C(6, 6) = 1, C(8, 6) = 28
]


@pytest.mark.parametrize("n,c,k,expected", HAND)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def binomial(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_the_binomial_form_and_stays_finite_at_large_n():
    for n in (1, 2, 7, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(binomial(n, c, k), abs=1e-12)

    # n = 2000: C(2000, 1000) has ~600 digits, far beyond a float; the product form
    # needs none of it
    assert pass_at_k(2000, 10, 1000) == pytest.approx(binomial(2000, 10, 1000), rel=1e-9)
    rising = [pass_at_k(2000, 1, k) for k in (1, 10, 1000)]
    assert 0 < rising[0] < rising[1] < rising[2] < 1


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs 0 <= c <= n and 1 <= k <= n"):
        pass_at_k(n, c, k)


def training(records):
    """The records less their timings and their evaluation metrics."""
    return [{k: v for k, v in r.items() if not k.startswith(("eval_", "pass@"))}
            for r in without_timings(records)]


def test_eval_samples_leave_training_unchanged(tmp_path):
    """The sampled evaluation leaves every training metric as a run without pass@k has it.

    The sampled evaluation is one engine call whatever --eval-samples. So the
    training's sampling streams, seeded by the engine's call number, stay those of
    a run without pass@k.
    """
    args = ["--engine", "hf", "--steps", "2", "--eval-every", "1", "--eval-size", "8",
            "--prompts-per-step", "4"]
    _, _, plain = run_train(args, tmp_path / "plain")
    sampled = args + ["--eval-samples", "3", "--eval-k", "2"]
    _, _, passk = run_train(sampled, tmp_path / "passk")

    assert all("pass@2" in r and "pass@3" not in r for r in passk)
    assert not any("pass@2" in r for r in plain)
    assert training(plain) == training(passk)
    assert len(plain) == 3
