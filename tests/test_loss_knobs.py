"""The loss knobs from train.py's side: their flags and the rules between them (in-process, config.py), how the
flags reach loss.policy_loss (loss_options), and one short train.py run per flag, which logs its metrics and only
then (loss.py's tests hold the math: tests/test_loss.py, tests/test_kernel.py, tests/test_loss_2ranks.py)."""
import pytest

import config
from config import check_flags
from helpers import run_train, train_parser, without_timings
from loss import loss_options

FAST = ["--engine", "hf", "--steps", "2", "--eval-size", "8", "--eval-every", "0", "--prompts-per-step", "4"]
# the default run's per-step loss metrics: no knob adds to them unless it is on
DEFAULT_LOSS_KEYS = ["clip_low", "clip_high", "clip_region", "ratio_mean", "entropy", "loss", "grad_norm"]
NEW_KEYS = {"frac_masked_truncated", "frac_low_entropy", "frac_is_masked", "frac_off_policy_masked",
            "is_ratio_mean", "is_ratio_max"}


def parse(argv):
    return config.fill_defaults(train_parser().parse_args(argv))


RULE_CASES = {  # argv: the one line check_flags prints
    "cispo's cap below 1": (["--loss-type", "cispo"], "--loss-type cispo caps the IS weight at --epsilon-high"),
    "IS bounds crossed": (["--is-correction", "token_mask", "--is-min", "2", "--is-max", "1"],
                          "--is-min 2.0 must be <= --is-max 1.0"),
    "tis-cap and is-correction": (["--tis-cap", "2", "--is-correction", "sequence_mask"],
                                  "--tis-cap C is --is-correction token_truncate --is-max C: give one of the two"),
    "--is-min alone": (["--is-min", "0.5"], "--is-min does nothing without --is-correction MODE"),
    "--is-max alone": (["--is-max", "2"], "--is-max does nothing without --is-correction MODE"),
    "--is-max with tis-cap": (["--tis-cap", "2", "--is-max", "2"], "--is-max does nothing without --is-correction"),
    "--sapo-tau alone": (["--sapo-tau", "1", "2"], "--sapo-tau does nothing without --loss-type sapo"),
    "--kl-bias-correction alone": (["--kl-bias-correction"], "--kl-bias-correction does nothing without --beta > 0"),
}


@pytest.mark.parametrize("name", RULE_CASES)
def test_rules_between_the_loss_flags(name, capsys):
    argv, expected = RULE_CASES[name]
    with pytest.raises(SystemExit) as e:
        check_flags(parse(argv))
    out = capsys.readouterr().out
    assert e.value.code == 2 and out.startswith("error: ") and expected in out and out.count("\n") == 1, out


@pytest.mark.parametrize("argv, expected", [
    (["--top-entropy-quantile", "1.5"], "argument --top-entropy-quantile: must be in [0, 1], got 1.5"),
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
    check_flags(parse(["--loss-type", "sapo", "--sapo-tau", "1", "1.1", "--beta", "0.04", "--kl-bias-correction",
                       "--is-correction", "token_mask", "--is-min", "0.5", "--is-max", "2", "--mask-truncated",
                       "--top-entropy-quantile", "0.2", "--off-policy-mask", "0.5"]))
    check_flags(parse(["--loss-type", "cispo", "--epsilon-high", "5"]))  # no SystemExit


def test_loss_options_map_the_flags():
    options = loss_options(parse(["--loss-type", "sapo", "--sapo-tau", "0.5", "2"]), "torch")
    assert (options["sapo_tau_pos"], options["sapo_tau_neg"], options["is_correction"]) == (0.5, 2.0, "off")
    alias = loss_options(parse(["--tis-cap", "2"]), "torch")
    assert (alias["is_correction"], alias["is_min"], alias["is_max"]) == ("token_truncate", 0.0, 2.0)
    assert alias == loss_options(parse(["--is-correction", "token_truncate", "--is-max", "2"]), "torch")
    assert "tis_cap" not in alias


# ---- one short run per flag ----------------------------------------------------------------------------

RUNS = {  # name: (flags, metric keys the steps log beyond the default's, keys they do not log)
    "cispo": (["--loss-type", "cispo", "--epsilon-high", "5"], set(), {"clip_low", "clip_region"}),
    "sapo": (["--loss-type", "sapo", "--sapo-tau", "1", "1.1"], set(), {"clip_low", "clip_high", "clip_region"}),
    "mask_truncated": (["--mask-truncated"], {"frac_masked_truncated"}, set()),
    "top_entropy": (["--top-entropy-quantile", "0.2"], {"frac_low_entropy"}, set()),
    "token_truncate": (["--is-correction", "token_truncate"], {"is_ratio_mean", "is_ratio_max"}, set()),
    "sequence_mask": (["--is-correction", "sequence_mask", "--is-max", "1.5", "--is-min", "0.5"],
                      {"is_ratio_mean", "is_ratio_max", "frac_is_masked"}, set()),
    "off_policy_mask": (["--off-policy-mask", "0.5"], {"frac_off_policy_masked"}, set()),
    "kl_bias_correction": (["--beta", "0.04", "--kl-bias-correction"], {"kl"}, set()),
}


@pytest.mark.parametrize("name", RUNS)
def test_a_run_per_knob(name, tmp_path):
    flags, logged, absent = RUNS[name]
    _, out, records = run_train(FAST + flags, tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        keys = set(DEFAULT_LOSS_KEYS) - absent | logged
        assert keys <= set(record) and not (absent & set(record)), set(record) ^ keys
        assert not (NEW_KEYS - logged) & set(record), (NEW_KEYS - logged) & set(record)
        assert all(record[k] == record[k] for k in keys), record  # no NaN
        for k in logged & NEW_KEYS - {"is_ratio_mean", "is_ratio_max"}:
            assert 0 <= record[k] <= 1, (k, record[k])
    if name == "mask_truncated":  # the untrained tiny model rarely stops: truncated completions leave the loss
        assert all((r["frac_masked_truncated"] > 0) == (r["truncated"] > 0) for r in records[1:])
    if name == "top_entropy":  # ~80% of the tokens are below the step's top 20% (ties at the threshold stay)
        assert all(0.5 < r["frac_low_entropy"] < 0.81 for r in records[1:]), [r["frac_low_entropy"] for r in records]
    assert ", loss torch (auto: " in out or ", loss triton (auto: " in out  # the start-up line says why


def test_tis_cap_is_token_truncate(tmp_path):
    """--tis-cap C runs exactly --is-correction token_truncate --is-max C: the same records."""
    _, _, alias = run_train(FAST + ["--tis-cap", "2"], tmp_path / "alias")
    _, _, mode = run_train(FAST + ["--is-correction", "token_truncate", "--is-max", "2"], tmp_path / "mode")
    assert without_timings(alias) == without_timings(mode) and "is_ratio_max" in alias[-1]


def test_batch_masks_on_two_ranks(tmp_path):
    """The entropy quantile's collective and the truncated normaliser, end to end under torchrun."""
    flags = ["--top-entropy-quantile", "0.2", "--mask-truncated", "--is-correction", "sequence_mask"]
    _, _, records = run_train(FAST + flags, tmp_path, nproc=2)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert {"frac_low_entropy", "frac_masked_truncated", "is_ratio_max"} <= set(records[-1])
