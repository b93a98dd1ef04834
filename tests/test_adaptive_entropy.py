"""--adaptive-entropy (Skywork-OR1, arXiv 2505.22312; TRL 1.16's rule).

The rule (adaptive_entropy.applied_coef and next_coef) against a plain loop
written from TRL's _compute_loss; the flags' rules (in-process, config.py); and
runs: with the gate always shut the run is bit-identical to one with no bonus,
and the coefficient moves by --entropy-coef-delta each step within its bounds. The kill-and-resume
test: tests/test_resume.py.
"""
import math

import pytest

from variants.adaptive_entropy import applied_coef as applied_entropy_coef
from variants.adaptive_entropy import next_coef as next_entropy_coef
from config import check_flags
from helpers import assert_run_loss_close, refused, run_train, without_timings
from helpers import parse_flags as parse

FAST = ["--engine", "hf", "--steps", "3", "--eval-size", "8", "--eval-every", "0",
        "--prompts-per-step", "4"]


def trl_controller(coef, entropies, target, delta, low, high):
    """TRL's controller over optimizer steps that measure `entropies`.

    -> (the coefficient each step applies, the coefficient after each step).
    """
    last = float("inf")  # _last_world_entropy before any step
    applied = []
    after = []
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        if entropy <= target:
            coef = min(coef + delta, high)
        else:
            coef = max(coef - delta, low)
        last = entropy
        after.append(coef)
    return applied, after


def test_the_rule_against_trls_loop():
    """Entropies around the target 0.5, bounds [0.0, 0.3], delta 0.1, from 0.1.

    The coefficient rises to its max and falls to its min; each step applies the
    one the step before left, and only when that step's entropy was <= target.
    """
    entropies = [0.9, 0.4, 0.3, 0.5, 0.2, 0.1, 0.8, 0.7, 0.6, 0.9, 0.4]
    target, delta, low, high = 0.5, 0.1, 0.0, 0.3

    coef = 0.1
    last = math.inf
    applied = []
    after = []
    for entropy in entropies:  # as train.py's loop calls them
        applied.append(applied_entropy_coef(coef, last, target))
        last = entropy
        coef = next_entropy_coef(coef, entropy, target, delta, low, high)
        after.append(coef)

    expected_applied, expected_after = trl_controller(0.1, entropies, target, delta, low, high)
    assert after == expected_after and applied == expected_applied
    # by hand: both bounds reached; no bonus at the first step or after a high entropy
    assert after == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.3, 0.3, 0.2, 0.1, 0.0, 0.0, 0.1])
    assert applied == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0])


RULE_CASES = {
    "target alone": (["--entropy-target", "0.3"],
                     "--entropy-target does nothing without --adaptive-entropy"),
    "delta alone": (["--entropy-coef-delta", "0.01"],
                    "--entropy-coef-delta does nothing without --adaptive-entropy"),
    "min alone": (["--entropy-coef-min", "0.01"],
                  "--entropy-coef-min does nothing without --adaptive-entropy"),
    "max alone": (["--entropy-coef-max", "0.5"],
                  "--entropy-coef-max does nothing without --adaptive-entropy"),
    "bounds crossed": (["--adaptive-entropy", "--entropy-coef-min", "0.5",
                        "--entropy-coef-max", "0.2", "--entropy-coef", "0.3"],
                       "--entropy-coef-min 0.5 must be <= --entropy-coef-max 0.2"),
    "start outside": (["--adaptive-entropy", "--entropy-coef-max", "0.05"],
                      "--adaptive-entropy starts from --entropy-coef 0.1: it must lie in"),
}


@pytest.mark.parametrize("name", RULE_CASES)
def test_rules(name, capsys):
    argv, expected = RULE_CASES[name]
    out = refused(argv, capsys)
    assert expected in out, out


def test_accepted_with_what_it_needs():
    # no SystemExit
    check_flags(parse(["--adaptive-entropy", "--entropy-target", "0.3",
                       "--entropy-coef-delta", "0.01", "--entropy-coef-min", "0.05",
                       "--entropy-coef-max", "0.5"]))


def drop(records, keys):
    return [{k: v for k, v in r.items() if k not in keys} for r in without_timings(records)]


def test_a_shut_gate_is_no_bonus(tmp_path):
    """Target 0: the tiny policy's entropy (~2.9) never gets there.

    The coefficient falls from the recipe's 0.1 by 0.005 a step and the bonus is
    never applied: every other number is that of a run with --entropy-coef 0, to
    fp32 rounding (that run's update takes the fused head, its projections on the
    real tokens only: fast.update.completion_logps): helpers.RUN_LOSS_TOL,
    relative and absolute, as its loss and KL are its smallest numbers.
    """
    _, out, records = run_train(FAST + ["--adaptive-entropy", "--entropy-target", "0"],
                                tmp_path / "adaptive")
    _, _, plain = run_train(FAST + ["--entropy-coef", "0"], tmp_path / "plain")

    assert [r["entropy_coef"] for r in records[1:]] == pytest.approx([0.095, 0.09, 0.085])
    assert all(r["entropy"] > 0 for r in records[1:])
    without_bonus = drop(records, {"entropy", "entropy_coef"})
    assert len(without_bonus) == len(plain)
    for record, plain_record in zip(without_bonus, drop(plain, set())):
        assert record.keys() == plain_record.keys()
        for key, value in plain_record.items():
            if isinstance(value, float):
                assert_run_loss_close(record[key], value, key)
            else:
                assert record[key] == value, key
    assert "entropy_coef 0.0950" in out


def test_an_open_gate_applies_last_steps_coefficient(tmp_path):
    """Target 100: the entropy is always below it, the coefficient rises.

    Step 1 applies nothing (no entropy measured yet): it is a no-bonus step.
    Step 2 applies 0.105, and its loss has the bonus in it.
    """
    _, _, records = run_train(FAST + ["--adaptive-entropy", "--entropy-target", "100"],
                              tmp_path / "adaptive")
    _, _, plain = run_train(FAST + ["--entropy-coef", "0"], tmp_path / "plain")

    assert [r["entropy_coef"] for r in records[1:]] == pytest.approx([0.105, 0.11, 0.115])
    assert drop(records[:2], {"entropy", "entropy_coef"}) == drop(plain[:2], set())
    assert records[2]["loss"] != plain[2]["loss"]
    # on-policy, the policy term averages about 0: the loss is about -0.105 x entropy
    assert records[2]["loss"] == pytest.approx(-0.105 * records[2]["entropy"], abs=0.05)
