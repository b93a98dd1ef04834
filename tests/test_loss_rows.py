"""The loss rows from TRL 1.16: luspo, vespo and --delta.

Each against a reference written plainly from TRL's _compute_loss and
get_gamma_weights (trl/trainer/grpo_trainer.py), value and gradient in float64
on random micro-batches; the rules that refuse the wrong combinations, in one
line; and one short train.py run per row. tests/test_loss.py holds them to its
token-by-token naive implementation and its micro-batch invariances too.
"""
import math

import pytest
import torch

from batch import UpdateBatch
from config import check_flags
from helpers import parse_flags as parse
from helpers import refused, run_train
from loss import LossSettings, check_settings, grpo_loss, importance_weight, policy_loss
from reduction import reduce_loss

f64 = dict(dtype=torch.float64)
SEEDS = range(4)


def random_case(seed, B=6, T=7, V=11):
    """float64 logits, ids, advantages of both signs, a ragged mask, and old and
    sampling log-probs within a few tenths of the current ones.

    -> (logits (B, T, V) leaf, ids, A (B,), mask (B, T), old, sampling).
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, **f64).requires_grad_()  # (B, T, V)
    ids = torch.randint(V, (B, T), generator=g)  # (B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # (B,)
    lengths[0] = T
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).to(torch.float64)  # (B, T)
    A = torch.randn(B, generator=g, **f64)  # (B,)
    A[0] = abs(A[0])
    A[1] = -abs(A[1])
    A[2] = 0.0  # A >= 0 takes the positive k, lambda

    logps = trl_logps(logits.detach(), ids)  # (B, T)
    old = logps + 0.4 * torch.randn(B, T, generator=g, **f64)
    sampling = old + 0.2 * torch.randn(B, T, generator=g, **f64)
    return logits, ids, A, mask, old, sampling


def trl_logps(logits, ids):
    """selective_log_softmax: the log-prob of each sampled token."""
    return torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


# -----------------------------------------------------------------------------
# The references, as TRL writes them (advantages (B, 1), no entropy, beta 0)

def trl_clipped(per_token_logps, old_per_token_logps, advantages, mask, loss_type,
                epsilon_low, epsilon_high, delta, level, num_items=None,
                max_completion_length=None):
    """TRL's grpo / bnpo / dr_grpo / dapo / luspo branch, with args.delta."""
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)

    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)

    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / num_items
    assert loss_type == "luspo"
    return (per_token_loss * mask).sum(-1).mean()


def trl_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio,
                      k_pos, lambda_pos, k_neg, lambda_neg):
    """get_gamma_weights, line for line."""
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
        seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)

    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    # TRL's torch.where(is_nonneg_adv, k_pos, k_neg) builds them in the default
    # dtype; here in float64, exact
    k_seq = torch.where(is_nonneg_adv, torch.tensor(k_pos, **f64), torch.tensor(k_neg, **f64))
    lambda_seq = torch.where(is_nonneg_adv, torch.tensor(lambda_pos, **f64),
                             torch.tensor(lambda_neg, **f64)).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


def trl_is_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min,
                 clip_max):
    """TRL's vLLM importance sampling ratio of a token_* mode."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    ratio = torch.exp(per_token_logps_diff)
    if mode == "token_truncate":
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    invalid = (ratio < clip_min) | (ratio > clip_max)
    return ratio.masked_fill(invalid, value=0.0)


def trl_vespo(per_token_logps, old_per_token_logps, advantages, mask, num_items,
              importance_sampling_ratio, k, lam):
    """TRL's vespo branch: -phi A logp, reduced like dapo, no IS ratio after."""
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    phi_seq = trl_gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio,
                                k[0], lam[0], k[1], lam[1])
    per_token_loss = -phi_seq * advantages * per_token_logps
    return (per_token_loss * mask).sum() / num_items, phi_seq


# -----------------------------------------------------------------------------
# Ours against them

def ours(logits, ids, A, mask, old, sampling=None, **settings):
    """policy_loss on the case: the minibatch is the micro-batch.

    settings: LossSettings' fields.
    """
    batch = UpdateBatch(completion_ids=ids, completion_mask=mask, advantages=A,
                        sampling_logps=sampling, old_logps=old)
    settings = LossSettings(max_new_tokens=mask.shape[1] + 2, **settings)

    return policy_loss(logits, batch, settings, minibatch_size=A.shape[0],
                       minibatch_tokens=mask.sum())


def assert_same_value_and_gradient(loss, expected, logits):
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-13)
    assert expected_grad.abs().max() > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("delta", [None, 1.3])
@pytest.mark.same_math
def test_luspo_matches_trl(seed, delta):
    """Sequence log-ratios shifted so that sequence 0 (A > 0) is clipped above
    and sequence 1 (A < 0) is above delta."""
    logits, ids, A, mask, old, _ = random_case(seed)
    old = old - torch.tensor([0.5, 0.6, 0.0, -0.5, 0.1, -0.1], **f64).unsqueeze(-1)
    kw = dict(loss_type="luspo", importance_sampling_level="sequence", epsilon_high=0.25)

    loss, metrics = ours(logits, ids, A, mask, old, delta=delta, **kw)
    expected = trl_clipped(trl_logps(logits, ids), old, A, mask, "luspo", 0.2, 0.25, delta,
                           "sequence")
    assert_same_value_and_gradient(loss, expected, logits)
    assert 0 < metrics["clip_region"] < 1

    # the cap holds sequence 1
    plain, _ = ours(logits, ids, A, mask, old, **kw)
    assert (plain.item() != loss.item()) == (delta is not None)


def test_luspo_weighs_each_sequence_by_its_length():
    """On-policy (ratio 1) the loss is -sum_i A_i |o_i| / B: grpo's would be
    -mean_i A_i."""
    logps = torch.zeros(2, 3, requires_grad=True)
    A = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])

    settings = LossSettings(loss_type="luspo", importance_sampling_level="sequence")
    loss, _ = grpo_loss(logps, None, None, A, mask, settings)
    assert loss.item() == pytest.approx(-(1.0 * 1 - 0.5 * 3) / 2)

    loss.backward()  # every token of sequence i: -A_i / B
    torch.testing.assert_close(logps.grad, -A.unsqueeze(-1) / 2 * mask)

    # a micro-batch of one sequence is its share of the minibatch of 2
    share = reduce_loss(torch.ones(1, 3), mask[1:], "luspo", num_sequences=2)
    assert share.item() == 1.5


VESPO_CASES = [
    # is_correction, is_min, is_max, (k_pos, k_neg), (lambda_pos, lambda_neg)
    ("off", 0.0, 3.0, (2.0, 3.0), (3.0, 2.0)),
    ("token_truncate", 0.0, 1.1, (2.0, 3.0), (3.0, 2.0)),
    ("token_mask", 0.9, 1.15, (1.5, 0.7), (0.5, 4.0)),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("is_correction, is_min, is_max, k, lam", VESPO_CASES)
@pytest.mark.same_math
def test_vespo_matches_trl(seed, is_correction, is_min, is_max, k, lam):
    """With the IS correction the ratio enters phi's log W, not the loss; the
    masked mode's zeros reach log W as log 1e-8."""
    logits, ids, A, mask, old, sampling = random_case(seed)

    loss, metrics = ours(logits, ids, A, mask, old, sampling, loss_type="vespo",
                         is_correction=is_correction, is_min=is_min, is_max=is_max,
                         vespo_k=k, vespo_lambda=lam)

    is_ratio = None
    if is_correction != "off":
        is_ratio = trl_is_ratio(old, sampling, mask, is_correction, is_min, is_max)
    expected, phi = trl_vespo(trl_logps(logits, ids), old, A, mask, mask.sum(), is_ratio,
                              k, lam)
    assert_same_value_and_gradient(loss, expected, logits)

    phi_mean = ((phi * mask).sum() / mask.sum()).item()  # a token mean
    assert metrics["vespo_phi_mean"] == pytest.approx(phi_mean, rel=1e-6)
    assert "clip_region" not in metrics
    assert ("is_ratio_mean" in metrics) == (is_ratio is not None)
    if is_correction == "token_mask":  # some weights are dropped, some kept
        assert 0 < (is_ratio[mask == 1] == 0).double().mean() < 1


def test_vespo_phi_by_hand():
    """phi(W) = e^lambda W^k e^(-lambda W); W = e^0.4 * e^0.3 (two tokens), and
    phi(1) = 1 on-policy: the plain policy gradient."""
    logps = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = logps.detach() - torch.tensor([[0.4, 0.3, 9.0]])  # the 9 is padding
    mask = torch.tensor([[1, 1, 0]])
    settings = LossSettings(loss_type="vespo")

    for A, k, lam in ((1.0, 2.0, 3.0), (-1.0, 3.0, 2.0)):
        w = math.exp(0.7)
        phi = math.exp(lam) * w ** k * math.exp(-lam * w)
        loss, m = grpo_loss(logps, old, None, torch.tensor([A]), mask, settings, num_items=2)
        assert loss.item() == pytest.approx(-phi * A * (-3.0) / 2)
        assert m["vespo_phi_mean"] == pytest.approx(phi)

    loss, m = grpo_loss(logps, None, None, torch.tensor([-1.0]), mask, settings, num_items=2)
    assert m["vespo_phi_mean"] == 1.0
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.5, 0.5, 0.0]]))


@pytest.mark.same_math
def test_vespo_ignores_padding_even_when_its_is_weight_is_not_one():
    """Padding's IS weight is exp(0) = 1, but is_min 1.1 truncates it to 1.1.

    TRL sums log IS over every position, so its phi would move with the
    padding; ours sums over the mask: one more padded position changes
    nothing.
    """
    logits, ids, A, mask, old, sampling = random_case(0, T=5)
    kw = dict(loss_type="vespo", is_correction="token_truncate", is_min=1.1, is_max=3.0)

    loss, metrics = ours(logits, ids, A, mask, old, sampling, **kw)
    pad = dict(value=0.0)
    longer = torch.nn.functional.pad(logits.detach(), (0, 0, 0, 1)).requires_grad_()
    padded = [torch.nn.functional.pad(x, (0, 1), **pad) for x in (ids, mask, old, sampling)]
    longer_loss, longer_metrics = ours(longer, padded[0], A, padded[1], padded[2], padded[3],
                                       **kw)

    torch.testing.assert_close(longer_loss, loss, rtol=1e-12, atol=1e-14)
    assert longer_metrics["vespo_phi_mean"] == pytest.approx(metrics["vespo_phi_mean"])
    weight = importance_weight(padded[2], padded[3], padded[1], "token_truncate", 1.1, 3.0)[0]
    assert (weight[padded[1] == 0] == 1.1).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.same_math
def test_delta_matches_trl(seed, loss_type):
    """Token-level ratios of 0.5-2 against delta = 1.4: some A < 0 tokens are
    capped."""
    logits, ids, A, mask, old, _ = random_case(seed)

    loss, _ = ours(logits, ids, A, mask, old, loss_type=loss_type, delta=1.4,
                   epsilon_low=0.15, epsilon_high=0.3)
    expected = trl_clipped(trl_logps(logits, ids), old, A, mask, loss_type, 0.15, 0.3, 1.4,
                           "token", num_items=mask.sum(),
                           max_completion_length=mask.shape[1] + 2)
    assert_same_value_and_gradient(loss, expected, logits)

    ratio = torch.exp(trl_logps(logits, ids) - old)  # (B, T)
    capped = (ratio > 1.4) & (A.unsqueeze(-1) < 0) & (mask == 1)
    assert capped.any() and (~capped & (mask == 1)).any()


def test_delta_caps_only_negative_advantages():
    """delta > 1 + eps_high: where A >= 0 the loss is the plain clip's; where
    A < 0 a ratio above delta has loss -delta A and no gradient, one between
    1 + eps_high and delta the unclipped -ratio A."""
    ratio = torch.tensor([[2.0], [1.3], [2.0], [0.5]])
    logps = torch.log(ratio).requires_grad_()
    old = torch.zeros(4, 1)
    A = torch.tensor([1.0, -1.0, -1.0, -1.0])
    kw = dict(loss_type="bnpo", epsilon_high=0.2)

    loss, _ = grpo_loss(logps, old, None, A, torch.ones(4, 1),
                        LossSettings(delta=1.5, **kw))
    assert loss.item() == pytest.approx((-1.2 + 1.3 + 1.5 + 0.8) / 4)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0], [1.3 / 4], [0.0], [0.0]]))

    plain, _ = grpo_loss(logps.detach(), old, None, A, torch.ones(4, 1), LossSettings(**kw))
    assert plain.item() == pytest.approx((-1.2 + 1.3 + 2.0 + 0.8) / 4)


# -----------------------------------------------------------------------------
# The rules: each wrong combination is refused in one line

# name: (argv, the one line check_flags prints)
RULE_CASES = {
    "luspo at token level": (
        ["--loss-type", "luspo"],
        "--loss-type luspo is GSPO's sequence ratio, weighed by length: add "
        "--importance-sampling-level sequence"),
    "vespo at sequence level": (
        ["--loss-type", "vespo", "--importance-sampling-level", "sequence"],
        "--loss-type vespo builds its sequence weight from the token ratios"),
    "vespo with sequence IS": (
        ["--loss-type", "vespo", "--is-correction", "sequence_mask"],
        "use --is-correction token_mask"),
    "vespo on the kernel": (
        ["--loss-type", "vespo", "--loss-impl", "triton"],
        "--loss-impl triton has no per-sequence weight for --loss-type vespo"),
    "delta with cispo": (
        ["--loss-type", "cispo", "--epsilon-high", "5", "--delta", "4"],
        "--delta does nothing without a clipped --loss-type"),
    "delta with sapo": (
        ["--loss-type", "sapo", "--delta", "4"],
        "--delta does nothing without a clipped --loss-type"),
    "delta with vespo": (
        ["--loss-type", "vespo", "--delta", "4"],
        "--delta does nothing without a clipped --loss-type"),
    "delta inside the clip": (
        ["--delta", "1.2", "--epsilon-high", "0.28"],
        "--delta 1.2 caps the ratio where A < 0 above the clip: give --delta > "
        "1 + --epsilon-high = 1.28"),
    "vespo-k alone": (
        ["--vespo-k", "1", "2"], "--vespo-k does nothing without --loss-type vespo"),
    "vespo-lambda alone": (
        ["--loss-type", "dapo", "--vespo-lambda", "1", "2"],
        "--vespo-lambda does nothing without --loss-type vespo"),
}


@pytest.mark.parametrize("name", RULE_CASES)
def test_wrong_combinations_are_refused_in_one_line(name, capsys):
    argv, expected = RULE_CASES[name]
    out = refused(argv, capsys)
    assert expected in out, out


def test_each_row_is_accepted_with_what_it_needs():
    check_flags(parse(["--loss-type", "luspo", "--importance-sampling-level", "sequence",
                       "--delta", "4"]))
    check_flags(parse(["--loss-type", "vespo", "--vespo-k", "1", "2", "--vespo-lambda",
                       "2", "1", "--is-correction", "token_truncate"]))
    check_flags(parse(["--loss-type", "vespo", "--tis-cap", "2"]))
    # no SystemExit
    check_flags(parse(["--loss-type", "dr_grpo", "--delta", "1.21"]))


@pytest.mark.parametrize("fields, name", [
    (dict(loss_type="luspo"), "luspo at token level"),
    (dict(loss_type="vespo", importance_sampling_level="sequence"), "vespo at sequence level"),
    (dict(loss_type="vespo", is_correction="sequence_mask"), "vespo with sequence IS"),
    (dict(loss_type="vespo", impl="triton"), "vespo on the kernel"),
    (dict(delta=1.2, epsilon_high=0.28), "delta inside the clip"),
])
def test_loss_settings_of_a_caller_are_refused_in_the_same_line(fields, name):
    """A caller that builds LossSettings itself runs the same rules
    (loss.check_settings): the line check_flags prints."""
    _, expected = RULE_CASES[name]
    with pytest.raises(ValueError) as e:
        check_settings(LossSettings(**fields))

    assert expected in str(e.value), e.value


# -----------------------------------------------------------------------------
# One short run per row

FAST = ["--engine", "hf", "--steps", "2", "--eval-size", "8", "--eval-every", "0",
        "--prompts-per-step", "4", "--num-iterations", "2"]
# name: (flags, loss metrics logged, loss metrics not logged)
RUNS = {
    "luspo": (["--loss-type", "luspo", "--importance-sampling-level", "sequence"],
              {"clip_low", "clip_high", "clip_region", "ratio_mean"}, {"vespo_phi_mean"}),
    "vespo": (["--loss-type", "vespo", "--vespo-k", "1.5", "3", "--is-correction",
               "token_truncate"], {"vespo_phi_mean", "ratio_mean", "is_ratio_mean"},
              {"clip_low", "clip_high", "clip_region"}),
    "delta": (["--delta", "1.5"], {"clip_low", "clip_high", "clip_region", "ratio_mean"},
              {"vespo_phi_mean"}),
}


@pytest.mark.parametrize("name", RUNS)
def test_a_run_per_row(name, tmp_path):
    flags, logged, absent = RUNS[name]
    _, out, records = run_train(FAST + flags, tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2]

    for record in records[1:]:
        assert logged <= set(record) and not absent & set(record), set(record)
        assert all(math.isfinite(record[k]) for k in logged | {"loss"}), record
    if name == "vespo":
        assert all(record["vespo_phi_mean"] > 0 for record in records[1:])

    # the start-up line says which path runs, and why
    if name == "delta":
        assert ", loss torch (auto: no CUDA" in out or ", loss triton (auto: " in out, out
    else:
        why = f", loss torch (auto: --loss-type {name} is sequence-level, the kernel per token)"
        assert why in out, out
