"""The loss knobs from train.py's side.

Their flags and the rules between them (in-process, config.py); how the flags
reach the loss (config.resolve_aliases, and train.py's LossSettings); and one
short train.py run per flag, which checks that it logs its metrics and only
them. loss.py's tests hold the math: tests/test_loss.py, tests/test_kernel.py,
tests/test_loss_2ranks.py.
"""
import ast
import dataclasses
import os

import pytest

import config
from config import check_flags
from helpers import ROOT, refused, run_train, train_parser, without_timings
from helpers import parse_flags as parse
from loss import LossSettings

FAST = ["--engine", "hf", "--steps", "2", "--eval-size", "8", "--eval-every", "0",
        "--prompts-per-step", "4"]
# the default run's per-step loss metrics: no knob adds to them unless it is on
DEFAULT_LOSS_KEYS = ["clip_low", "clip_high", "clip_region", "ratio_mean", "entropy",
                     "loss", "grad_norm"]
NEW_KEYS = {"frac_masked_truncated", "frac_low_entropy", "frac_is_masked",
            "frac_off_policy_masked", "is_ratio_mean", "is_ratio_max"}


# name: (argv, the one line check_flags prints)
RULE_CASES = {
    "cispo's cap below 1": (
        ["--loss-type", "cispo"],
        "--loss-type cispo caps the IS weight at --epsilon-high"),
    "IS bounds crossed": (
        ["--is-correction", "token_mask", "--is-min", "2", "--is-max", "1"],
        "--is-min 2.0 must be <= --is-max 1.0"),
    "tis-cap and is-correction": (
        ["--tis-cap", "2", "--is-correction", "sequence_mask"],
        "--tis-cap C is --is-correction token_truncate --is-max C: give one of the two"),
    "--is-min alone": (
        ["--is-min", "0.5"],
        "--is-min does nothing without --is-correction MODE"),
    "--is-max alone": (
        ["--is-max", "2"],
        "--is-max does nothing without --is-correction MODE"),
    "--is-max with tis-cap": (
        ["--tis-cap", "2", "--is-max", "2"],
        "--is-max does nothing without --is-correction"),
    "--sapo-tau alone": (
        ["--sapo-tau", "1", "2"],
        "--sapo-tau does nothing without --loss-type sapo"),
    "--kl-bias-correction alone": (
        ["--kl-bias-correction"],
        "--kl-bias-correction does nothing without --beta > 0"),
}


@pytest.mark.parametrize("name", RULE_CASES)
def test_rules_between_the_loss_flags(name, capsys):
    argv, expected = RULE_CASES[name]
    out = refused(argv, capsys)
    assert expected in out, out


@pytest.mark.parametrize("argv, expected", [
    (["--top-entropy-quantile", "1.5"],
     "argument --top-entropy-quantile: must be in [0, 1], got 1.5"),
    (["--is-max", "0"], "argument --is-max: must be > 0, got 0"),
    (["--is-min", "-1"], "argument --is-min: must be >= 0, got -1"),
    (["--off-policy-mask", "nan"], "argument --off-policy-mask: must be >= 0, got nan"),
    (["--sapo-tau", "1", "0"], "argument --sapo-tau: must be > 0, got 0"),
    (["--is-correction", "token"], "invalid choice: 'token'"),
    (["--loss-type", "ppo"], "invalid choice: 'ppo'"),
])
def test_bad_loss_flag_values(argv, expected, capsys):
    with pytest.raises(SystemExit):
        train_parser().parse_args(argv)

    out = capsys.readouterr().out
    assert expected in out and out.count("\n") == 1, out


def test_every_knob_is_accepted_with_what_it_needs():
    check_flags(parse(["--loss-type", "sapo", "--sapo-tau", "1", "1.1", "--beta", "0.04",
                       "--kl-bias-correction", "--is-correction", "token_mask",
                       "--is-min", "0.5", "--is-max", "2", "--mask-truncated",
                       "--top-entropy-quantile", "0.2", "--off-policy-mask", "0.5"]))
    # no SystemExit
    check_flags(parse(["--loss-type", "cispo", "--epsilon-high", "5"]))


def test_resolve_aliases_sets_what_tis_cap_stands_for():
    """--tis-cap C becomes --is-correction token_truncate --is-max C, in place.

    Every other flag is what the long form gives, and the loss never sees
    tis_cap: it is no field of LossSettings.
    """
    alias = parse(["--tis-cap", "2"])
    check_flags(alias)
    assert config.resolve_aliases(alias) is alias
    assert alias.is_correction == "token_truncate"
    assert alias.is_min == 0.0 and alias.is_max == 2.0

    mode = parse(["--is-correction", "token_truncate", "--is-max", "2"])
    check_flags(mode)
    config.resolve_aliases(mode)
    alias_flags = {k: v for k, v in vars(alias).items() if k != "tis_cap"}
    mode_flags = {k: v for k, v in vars(mode).items() if k != "tis_cap"}
    assert alias_flags == mode_flags
    assert "tis_cap" not in {field.name for field in dataclasses.fields(LossSettings)}

    # without the alias, nothing changes
    plain = parse(["--loss-type", "sapo", "--sapo-tau", "0.5", "2"])
    before = dict(vars(plain))
    config.resolve_aliases(plain)
    assert vars(plain) == before
    assert plain.sapo_tau == [0.5, 2.0] and plain.is_correction == "off"


def test_train_py_builds_the_loss_settings_from_the_flags():
    """train.py builds its LossSettings once, with from_flags: no field is
    listed by hand. Each field but impl (choose_impl's) is the flag of its
    name; --sapo-tau POS NEG is the pair sapo_tau."""
    with open(os.path.join(ROOT, "train.py")) as f:
        tree = ast.parse(f.read())
    calls = [ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)]
    built = [name for name in calls if name in ("LossSettings", "LossSettings.from_flags")]
    assert built == ["LossSettings.from_flags"], built

    args = parse(["--loss-type", "sapo", "--sapo-tau", "0.5", "2", "--beta", "0.04"])
    settings = LossSettings.from_flags(args, impl="torch")
    for field in dataclasses.fields(LossSettings):
        if field.name == "impl":
            continue
        flag = getattr(args, field.name)
        if isinstance(flag, list):  # the pairs
            flag = tuple(flag)
        assert getattr(settings, field.name) == flag, field.name
    assert settings.sapo_tau == (0.5, 2.0) and settings.impl == "torch"
    hash(settings)  # frozen all through: the pairs are tuples


# ---- one short run per flag ----------------------------------------------------

# name: (flags, metric keys the steps log beyond the default's, keys they do
# not log)
RUNS = {
    "cispo": (["--loss-type", "cispo", "--epsilon-high", "5"], set(),
              {"clip_low", "clip_region"}),
    "sapo": (["--loss-type", "sapo", "--sapo-tau", "1", "1.1"], set(),
             {"clip_low", "clip_high", "clip_region"}),
    "mask_truncated": (["--mask-truncated"], {"frac_masked_truncated"}, set()),
    "top_entropy": (["--top-entropy-quantile", "0.2"], {"frac_low_entropy"}, set()),
    "token_truncate": (["--is-correction", "token_truncate"],
                       {"is_ratio_mean", "is_ratio_max"}, set()),
    "sequence_mask": (["--is-correction", "sequence_mask", "--is-max", "1.5",
                       "--is-min", "0.5"],
                      {"is_ratio_mean", "is_ratio_max", "frac_is_masked"}, set()),
    "off_policy_mask": (["--off-policy-mask", "0.5"], {"frac_off_policy_masked"}, set()),
    "kl_bias_correction": (["--beta", "0.04", "--kl-bias-correction"], {"kl"}, set()),
}


@pytest.mark.parametrize("name", RUNS)
def test_a_run_per_knob(name, tmp_path):
    flags, logged, absent = RUNS[name]
    _, out, records = run_train(FAST + flags, tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]

    keys = set(DEFAULT_LOSS_KEYS) - absent | logged
    fractions = logged & NEW_KEYS - {"is_ratio_mean", "is_ratio_max"}
    for record in records[1:]:
        assert keys <= set(record) and not (absent & set(record)), set(record) ^ keys
        assert not (NEW_KEYS - logged) & set(record), (NEW_KEYS - logged) & set(record)
        assert all(record[k] == record[k] for k in keys), record  # no NaN
        for k in fractions:
            assert 0 <= record[k] <= 1, (k, record[k])

    # the untrained tiny model rarely stops: truncated completions leave the loss
    if name == "mask_truncated":
        for r in records[1:]:
            assert (r["frac_masked_truncated"] > 0) == (r["truncated"] > 0), r

    # ~80% of the tokens are below the step's top 20% (ties at the threshold stay)
    if name == "top_entropy":
        low = [r["frac_low_entropy"] for r in records[1:]]
        assert all(0.5 < x < 0.81 for x in low), low

    # the start-up line says why
    assert ", loss torch (auto: " in out or ", loss triton (auto: " in out


def test_tis_cap_is_token_truncate(tmp_path):
    """--tis-cap C runs exactly --is-correction token_truncate --is-max C: the
    same records."""
    _, _, alias = run_train(FAST + ["--tis-cap", "2"], tmp_path / "alias")
    long_form = ["--is-correction", "token_truncate", "--is-max", "2"]
    _, _, mode = run_train(FAST + long_form, tmp_path / "mode")

    assert without_timings(alias) == without_timings(mode) and "is_ratio_max" in alias[-1]


def test_batch_masks_on_two_ranks(tmp_path):
    """The entropy quantile's collective and the truncated normaliser, end to
    end under torchrun."""
    flags = ["--top-entropy-quantile", "0.2", "--mask-truncated",
             "--is-correction", "sequence_mask"]
    _, _, records = run_train(FAST + flags, tmp_path, nproc=2)

    assert [r["step"] for r in records] == [0, 1, 2]
    expected = {"frac_low_entropy", "frac_masked_truncated", "is_ratio_max"}
    assert expected <= set(records[-1])
