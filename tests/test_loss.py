"""loss.py: hand-computed values, gradients, input errors, micro-batch
invariance, and policy_loss's two paths.

The gradients are checked with gradcheck in float64, and with autograd through
a naive implementation.
"""
import dataclasses
import itertools
import math

import pytest
import torch

from batch import UpdateBatch
from fast.dedup import unique_rows
from variants.high_entropy import high_entropy_mask, quantile_over_ranks
from config import CLIPPED_LOSS_TYPES, LOSS_TYPES
from config import check_loss_settings as check_settings
from loss import LossSettings, choose_impl, grpo_loss, minibatch_tokens, policy_loss, reduce_loss
from runlog.metrics import step_metrics, token_stats
import fast.update
from helpers import FP64_TOL, assert_close_rel, fp32_tol
from model import entropy_from_logits, selective_log_softmax
from variants.reductions import REDUCTIONS, dapo
from variants.token_weights import importance_weight, off_policy_keep, policy_weight

f64 = dict(dtype=torch.float64)


# ---- selective_log_softmax / entropy_from_logits -------------------------------
# model.py's plain ones, and fast/update.py's (by chunks of rows, the log-prob's
# backward by hand)

def test_selective_log_softmax_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # (1, 2, 2)
    ids = torch.tensor([[1, 0]])
    out = selective_log_softmax(logits, ids)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(0.5)]]))

    # temperature 2 turns logits (0, 2 ln 3) into (0, ln 3)
    logits = torch.tensor([[[0.0, 2 * math.log(3.0)]]])
    out_t = selective_log_softmax(logits, torch.tensor([[1]]), 2.0)
    torch.testing.assert_close(out_t, torch.tensor([[math.log(0.75)]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.same_math
def test_selective_log_softmax_matches_full_log_softmax_in_chunks(dtype):
    """The same math: in fp64 to FP64_TOL, from fp32 or bf16 logits (fp32
    log-probs) to fp32 rounding, fp32_tol of a row's 50 logits and the
    log-prob's own magnitude (~|logit| / 0.7)."""
    torch.manual_seed(0)
    model_logits = (3 * torch.randn(3, 8, 50)).to(dtype).requires_grad_()
    logits = model_logits[:, :-1]  # (3, 7, 50), not contiguous, as in a trainer
    ids = torch.randint(50, (3, 7))
    out_dtype = torch.promote_types(dtype, torch.float32)
    log_probs = (logits.to(out_dtype) / 0.7).log_softmax(-1)  # (3, 7, 50)
    full = log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (3, 7)
    (grad_full,) = torch.autograd.grad(full.square().sum(), model_logits)

    # the plain one; then all at once, positions, ragged pieces, one sequence, 2 (ragged)
    ways = [lambda: selective_log_softmax(logits, ids, 0.7)]
    for chunk_rows in (None, 1, 4, 7, 14):
        ways.append(lambda rows=chunk_rows: fast.update.selective_log_softmax(
            logits, ids, 0.7, chunk_rows=rows))
    tol = FP64_TOL if dtype == torch.float64 else fp32_tol(50 + full.abs().max().item())
    for way in ways:
        out = way()
        assert out.dtype == out_dtype
        assert_close_rel(out, full, tol, msg="log-probs")

        (grad,) = torch.autograd.grad(out.square().sum(), model_logits)
        if dtype != torch.bfloat16:
            assert_close_rel(grad, grad_full, tol, msg="grad")
        else:  # the gradient is stored in bf16: equal up to one bf16 rounding
            torch.testing.assert_close(grad.float(), grad_full.float(), rtol=1e-2,
                                       atol=1e-3)


def test_log_prob_backward_by_gradcheck_and_what_it_saves():
    """fast.update.ChosenLogps's hand-written backward: gradcheck in float64, FILTERED
    and -inf logits included; and for backward it keeps the logits as they came
    (bf16 stays bf16) and one number a row, not an fp32 copy of the logits."""
    from sampling.truncation import FILTERED

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, **f64)
    logits[0, 1, 4] = FILTERED
    logits[1, 2, 5] = -torch.inf
    logits.requires_grad_()
    ids = torch.tensor([[0, 1, 2], [3, 4, 0]])
    chosen_logps = fast.update.selective_log_softmax
    assert torch.autograd.gradcheck(lambda x: chosen_logps(x, ids, 0.7), (logits,))

    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    bf16 = torch.randn(4, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chosen_logps(bf16, torch.randint(64, (4, 5)), 0.7).sum().backward()
    logits_sized = [t for t in saved if t.numel() == bf16.numel()]
    assert len(logits_sized) == 1 and logits_sized[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved) == bf16.numel() + 2 * 4 * 5  # + ids, lse


def test_chunks_are_checkpointed_only_when_there_are_several(monkeypatch):
    """One chunk runs plainly: the default run's logits are tiny, and
    checkpointing each row cost 500x. Several chunks are each checkpointed, so no
    fp32 copy of more than one chunk is kept for backward (the bound at
    V = 151,936).
    """
    calls = []

    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(1)
        return fn(*args)

    monkeypatch.setattr(fast.update, "checkpoint", counting_checkpoint)
    logits = torch.randn(3, 7, 50, requires_grad=True)
    ids = torch.randint(50, (3, 7))

    for chunk_rows, expected in ((None, 0), (21, 0), (14, 2), (7, 3), (4, 6)):
        calls.clear()
        fast.update.selective_log_softmax(logits, ids, chunk_rows=chunk_rows).sum().backward()
        assert len(calls) == expected, (chunk_rows, len(calls))

    # the default bound: one sequence of V = 50 per chunk
    monkeypatch.setattr(fast.update, "CHUNK_ELEMENTS", 7 * 50)
    calls.clear()
    fast.update.entropy_from_logits(logits).sum().backward()
    assert len(calls) == 3


@pytest.mark.parametrize("entropy", [entropy_from_logits, fast.update.entropy_from_logits])
def test_entropy_by_hand(entropy):
    uniform = torch.zeros(2, 3, 8)
    expected = torch.full((2, 3), math.log(8))
    torch.testing.assert_close(entropy(uniform), expected)

    two = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (1/4, 3/4)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy(two), torch.tensor([[expected]]))

    # temperature -> infinity flattens any distribution to uniform
    peaked = torch.tensor([[[0.0, 5.0]]])
    expected = torch.tensor([[math.log(2)]])
    torch.testing.assert_close(entropy(peaked, 1e6), expected)


def test_chunked_functions_gradcheck_float64():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, **f64, requires_grad=True)
    ids = torch.randint(5, (2, 3))

    def logps(x):
        return fast.update.selective_log_softmax(x, ids, 0.8, chunk_rows=2)

    def entropies(x):
        return fast.update.entropy_from_logits(x, 1.3, chunk_rows=4)

    assert torch.autograd.gradcheck(logps, (logits,))
    assert torch.autograd.gradcheck(entropies, (logits,))


# ---- reduce_loss ---------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("loss_type, kwargs, expected", [
    ("grpo", {}, (1.5 + 4.0) / 2),  # mean of per-sequence means
    ("bnpo", {}, 7.0 / 3),  # 1+2+4 over 3 tokens
    ("dr_grpo", {"max_new_tokens": 4}, 7.0 / (2 * 4)),  # over B * L
    ("dapo", {"num_items": 14}, 7.0 / 14),  # over the generation batch
])
def test_reduce_loss_by_hand(loss_type, kwargs, expected):
    loss = reduce_loss(PER_TOKEN, MASK, loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected)


def test_reduce_loss_empty_sequence_counts_as_zero():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert reduce_loss(PER_TOKEN, mask, "grpo").item() == pytest.approx(1.5 / 2)


# ---- grpo_loss: values by hand -------------------------------------------------

def test_on_policy_is_plain_policy_gradient():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])

    loss, metrics = grpo_loss(logps, None, None, adv, mask, LossSettings())
    assert loss.item() == pytest.approx(-(1.0 + -2.0) / 2)  # ratio is 1: -mean_i A_i
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_region"] == 0.0
    assert "kl" not in metrics

    loss.backward()  # d/dlogp = -A_i / len_i / B
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -0.25], [1.0, 0.0]]))


def test_clipping_by_hand():
    # ratios 1.5 (A=+1, clipped high), 0.5 (A=-1, clipped low), 1.5 (A=-1, not
    # clipped: the pessimistic bound)
    logps = torch.log(torch.tensor([[1.5], [0.5], [1.5]])).requires_grad_()
    old = torch.zeros(3, 1)
    adv = torch.tensor([1.0, -1.0, -1.0])

    settings = LossSettings(loss_type="bnpo")
    loss, metrics = grpo_loss(logps, old, None, adv, torch.ones(3, 1), settings)
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5) / 3)

    loss.backward()  # clipped tokens get no gradient; d(ratio)/d(logp) = ratio
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0], [0.0], [1.5 / 3]]))
    assert metrics["clip_high"] == pytest.approx(1 / 3)
    assert metrics["clip_low"] == pytest.approx(1 / 3)
    assert metrics["clip_region"] == pytest.approx(2 / 3)
    assert metrics["ratio_mean"] == pytest.approx(3.5 / 3)


def test_asymmetric_clip_higher():
    """DAPO's clip-higher: eps_high 0.28 lets ratio 1.25 through."""
    logps = torch.log(torch.tensor([[1.25]]))
    old = torch.zeros(1, 1)
    adv = torch.tensor([1.0])

    settings = LossSettings(epsilon_high=0.28)
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(1, 1), settings)
    assert loss.item() == pytest.approx(-1.25) and m["clip_high"] == 0.0

    loss, m = grpo_loss(logps, old, None, adv, torch.ones(1, 1), LossSettings())
    assert loss.item() == pytest.approx(-1.2) and m["clip_high"] == 1.0


def test_k3_kl_by_hand():
    logps = torch.tensor([[-1.0, -1.0]])
    # ref - logp = ln 2 -> kl = 2 - ln 2 - 1; equal -> 0
    ref = logps + torch.tensor([[math.log(2.0), 0.0]])
    kl = 1 - math.log(2.0)
    adv = torch.tensor([0.0])

    loss, m = grpo_loss(logps, None, ref, adv, torch.ones(1, 2), LossSettings(beta=0.5))
    assert loss.item() == pytest.approx(0.5 * kl / 2) and m["kl"] == pytest.approx(kl / 2)

    _, m0 = grpo_loss(logps, None, ref, adv, torch.ones(1, 2), LossSettings(beta=0.0))
    assert m0["kl"] == pytest.approx(kl / 2)  # logged even when it is not in the loss


def test_sequence_level_ratio_is_geometric_mean():
    logps = torch.zeros(1, 3)
    # token log-ratios 0.1, 0.3; the third token is padding
    old = torch.tensor([[-0.1, -0.3, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.tensor([1.0])

    settings = LossSettings(importance_sampling_level="sequence", epsilon_high=0.5)
    loss, m = grpo_loss(logps, old, None, adv, mask, settings)
    assert loss.item() == pytest.approx(-math.exp(0.2))
    assert m["ratio_mean"] == pytest.approx(math.exp(0.2))

    settings = LossSettings(importance_sampling_level="token", epsilon_high=0.5)
    loss, m = grpo_loss(logps, old, None, adv, mask, settings)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.3)) / 2)


def test_truncated_importance_sampling_weight():
    logps = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    # weights exp(old - sampling) = 0.5 and 4 -> cap 2
    sampling = torch.tensor([[math.log(2.0), -math.log(4.0)]])
    mask = torch.ones(1, 2)

    weight, ratio, outside = importance_weight(old, sampling, mask, "token_truncate",
                                               is_max=2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0]]))
    torch.testing.assert_close(ratio, torch.tensor([[0.5, 4.0]]))
    assert outside is None  # truncate modes drop no token

    loss, _ = grpo_loss(logps, old, None, torch.tensor([1.0]), mask, LossSettings(),
                        token_weight=weight)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -1.0]]))

    # a constant, even from the current logps
    weight = importance_weight(logps, sampling, mask, "token_truncate")[0]
    assert not weight.requires_grad


def test_entropy_bonus():
    logps = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)

    adv = torch.tensor([1.0])
    settings = LossSettings(entropy_coef=0.1)
    loss, m = grpo_loss(logps, None, None, adv, torch.ones(1, 2), settings, entropies=ent)
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 2.0)
    assert m["entropy"] == pytest.approx(2.0)

    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.05, -0.05]]))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus_is_the_mean_token_entropy_whatever_the_loss_type(loss_type):
    """Sequences of 1 and 3 tokens, entropies 1 and (2, 3, 4).

    The bonus is 0.1 x the token mean 2.5 for every loss type. Inside the
    per-token loss, dr_grpo would give 0.1 x 10 / (2 x 8) and grpo
    0.1 x mean(1, 3) = 0.2.
    """
    ent = torch.tensor([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    num_items = None
    if REDUCTIONS.get(loss_type) is dapo:
        num_items = 4

    level = "sequence" if loss_type == "luspo" else "token"
    settings = LossSettings(loss_type=loss_type, entropy_coef=0.1, max_new_tokens=8,
                            importance_sampling_level=level)
    loss, m = grpo_loss(torch.zeros(2, 3), None, None, torch.zeros(2), mask, settings,
                        entropies=ent, num_items=num_items)
    assert loss.item() == pytest.approx(-0.25) and m["entropy"] == pytest.approx(2.5)

    loss.backward()
    torch.testing.assert_close(ent.grad, -0.1 / 4 * mask.float())


ADD_UP_CASES = list(itertools.product(LOSS_TYPES, ("all", "knobs", "token_mask")))


@pytest.mark.parametrize("loss_type, options", ADD_UP_CASES)
@pytest.mark.same_math
def test_micro_batch_losses_add_up_to_the_minibatch_loss(loss_type, options):
    """policy_loss over micro-batches of 1, 2 or 4 sequences.

    The losses (and gradients) sum to the whole minibatch's, entropy bonus, KL
    and every mask included. The logged loss of the minibatch is that sum, and
    the step's metrics (step_metrics) are the same at every micro-batch size.
    In fp64: the same math, to FP64_TOL.
    """
    logits, batch, settings, share = _micro_batch(OPTIONS[options])
    logits, batch, _ = _fp64(logits, batch, share)
    settings = _settings(loss_type, settings)
    # the 4 sequences are the whole minibatch
    tokens = minibatch_tokens(batch.completion_mask, batch.truncated)

    totals = []
    for micro in (4, 2, 1):
        loss = 0.0
        grad = torch.zeros_like(logits)
        micro_metrics = []

        for i in range(0, 4, micro):
            r = slice(i, i + micro)
            part = batch.select(r)
            share, metrics = policy_loss(logits[r], part, settings, minibatch_size=4,
                                         minibatch_tokens=tokens)
            assert metrics["loss"] == pytest.approx(share.item())
            assert metrics["tokens"] == part.completion_mask.sum().item()

            grad[r] += torch.autograd.grad(share, logits)[0][r]
            loss += share.item()
            micro_metrics.append(metrics)

        logged = step_metrics(micro_metrics, [torch.tensor(1.0)])
        totals.append((loss, grad, logged))

    first_loss, first_grad, first_logged = totals[0]
    for loss, grad, logged in totals[1:]:
        # relative to the loss's terms, of order 1 (they may cancel)
        assert_close_rel(loss, first_loss, FP64_TOL, scale=max(1.0, abs(first_loss)), msg="loss")
        assert_close_rel(grad, first_grad, FP64_TOL, msg="grad")
        assert list(logged) == list(first_logged)
        for key, value in first_logged.items():
            assert_close_rel(logged[key], value, FP64_TOL, scale=max(1.0, abs(value)), msg=key)


# ---- grpo_loss: gradients ------------------------------------------------------

def _gradcheck_inputs():
    """-> (logps, old, ref, adv, mask, entropies, log_ratio), float64."""
    torch.manual_seed(0)
    B = 4
    T = 5
    log_ratio = torch.tensor([[0.5, -0.05, 0.3, -0.6, 0.1],
                              [-0.4, 0.05, 0.4, 0.0, 0.2],
                              [0.02, -0.5, 0.6, 0.1, -0.1],
                              [0.3, 0.4, -0.1, 0.35, 0.25]], **f64)
    logps = -torch.rand(B, T, **f64) - 0.1
    mask = torch.tensor([[1, 1, 1, 1, 1],
                         [1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0],
                         [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.7, -1.3, 0.8], **f64)
    ref = logps + 0.3 * torch.randn(B, T, **f64)
    entropies = torch.rand(B, T, **f64) + 0.5

    return logps, logps - log_ratio, ref, adv, mask, entropies, log_ratio


# cispo and vespo are not gradcheck-able by design: their weights,
# sg(min(ratio, eps_high)) and sg(phi_i), are constant only to autograd
# (test_cispo_by_hand, tests/test_loss_rows.py and the naive implementation
# below check their gradients)
SMOOTH_TYPES = [t for t in LOSS_TYPES if t not in ("cispo", "vespo")]
KL_OPTIONS = [(0.0, False), (0.04, False), (0.04, True)]  # (beta, kl_bias_correction)


# luspo is sequence-level only
GRADCHECK_CASES = [case for case in itertools.product(SMOOTH_TYPES, ("token", "sequence"),
                                                      KL_OPTIONS)
                   if case[0] != "luspo" or case[1] == "sequence"]


@pytest.mark.parametrize("loss_type, level, kl", GRADCHECK_CASES)
def test_grpo_loss_gradcheck(loss_type, level, kl):
    logps, old, ref, adv, mask, ent, log_ratio = _gradcheck_inputs()

    # the inputs hold clipped and unclipped tokens, none within 1e-2 of a clip
    # boundary (finite differences)
    lr = log_ratio
    if level == "sequence":
        lr = ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand(-1, 5)
    for bound in (math.log(0.8), math.log(1.2)):
        assert (lr - bound).abs().min() > 1e-2

    beta, kl_bias_correction = kl
    kw = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level,
              max_new_tokens=6, kl_bias_correction=kl_bias_correction)
    _, metrics = grpo_loss(logps, old, ref, adv, mask, LossSettings(**kw), num_items=17)
    assert loss_type == "sapo" or 0 < metrics["clip_region"] < 1

    settings = LossSettings(entropy_coef=0.01, **kw)

    def loss(lp, e):
        return grpo_loss(lp, old, ref, adv, mask, settings, entropies=e, num_items=17)[0]

    inputs = (logps.clone().requires_grad_(), ent.clone().requires_grad_())
    assert torch.autograd.gradcheck(loss, inputs)


def test_gradcheck_tis():
    # old_logps=None is not gradcheck-able by design: logps.detach() is constant
    # only to autograd. test_on_policy_is_plain_policy_gradient checks that
    # gradient by hand.
    logps, old, ref, adv, mask, _, _ = _gradcheck_inputs()
    sampling = old + 0.2 * torch.randn(old.shape, **f64)
    weight = importance_weight(old, sampling, mask, "token_truncate", is_max=1.1)[0]
    settings = LossSettings(beta=0.1)

    def loss(lp):
        return grpo_loss(lp, old, ref, adv, mask, settings, token_weight=weight)[0]

    assert torch.autograd.gradcheck(loss, (logps.clone().requires_grad_(),))


# ---- errors --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="ppo"), "loss_type='ppo'"),
    (dict(loss_type="dapo"), "num_items"),
    (dict(loss_type="dr_grpo"), "max_new_tokens"),
    (dict(beta=0.1), "ref_logps"),
    (dict(entropy_coef=0.1), "entropies"),
])
def test_errors(kwargs, match):
    """An unknown loss type and the last two raise in grpo_loss, the others in
    its reduce_loss."""
    with pytest.raises(ValueError, match=match):
        grpo_loss(torch.zeros(1, 2), None, None, torch.ones(1), torch.ones(1, 2),
                  LossSettings(**kwargs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(importance_sampling_level="tokens"), "importance_sampling_level='tokens'"),
    (dict(is_correction="sequence"), "is_correction='sequence'"),
    (dict(impl="auto"), "choose_impl resolves 'auto'"),
    (dict(loss_type="vespo", vespo_lambda=(3.0, 0.0)), "vespo's k and lambda must be > 0"),
])
def test_check_settings_refuses_what_the_flags_parser_would(kwargs, match):
    """A caller that builds LossSettings itself has no argparse: check_settings
    refuses the values that the loss would not."""
    check_settings(LossSettings())  # the defaults pass

    with pytest.raises(ValueError, match=match):
        check_settings(LossSettings(**kwargs))


def test_knobs_without_sampling_logps():
    with pytest.raises(ValueError, match="sampling_logps"):
        importance_weight(torch.zeros(1, 2), None, torch.ones(1, 2), "token_truncate",
                          is_max=2.0)

    with pytest.raises(ValueError, match="sampling_logps"):
        off_policy_keep(torch.ones(1), torch.zeros(1, 2), None, torch.ones(1, 2), 0.5)

    # an unknown mode: check_settings refuses it before any loss runs
    with pytest.raises(ValueError, match="is_correction"):
        check_settings(LossSettings(is_correction="sequence"))


def test_reduce_loss_errors():
    with pytest.raises(ValueError, match="loss_type"):
        reduce_loss(PER_TOKEN, MASK, "mean")

    with pytest.raises(ValueError, match="num_items"):
        reduce_loss(PER_TOKEN, MASK, "dapo")


def test_entropy_with_banned_tokens_is_finite():
    """-inf logits (banned tokens) have p = 0 and add nothing.

    The entropy is over the rest, and the gradient is finite.
    """
    logits = torch.tensor([[[0.0, 0.0, -float("inf"), 0.0]]])  # (1, 1, 4)
    logits.requires_grad_()
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.log(torch.tensor([[3.0]])))

    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ---- policy_loss: a micro-batch from logits, either path -----------------------

# what train.py can pass; every set runs with every loss type on the torch path.
# "old" and "masks" are _micro_batch's; the rest are LossSettings' fields.
OPTIONS = {
    "plain": dict(),
    "all": dict(temperature=0.7, epsilon_high=0.28, beta=0.04, entropy_coef=0.01,
                is_correction="token_truncate", is_max=2.0),
    # ref_logps given at beta = 0: kl is logged, not in the loss
    "on_policy_tis": dict(old=False, is_correction="token_truncate", is_max=2.0),
    "gspo": dict(importance_sampling_level="sequence", beta=0.04),
    # every mask at once, each removing some tokens and keeping others
    # (test_knobs_fire)
    "knobs": dict(temperature=0.7, beta=0.04, kl_bias_correction=True, entropy_coef=0.01,
                  is_correction="sequence_mask", is_max=1.2, off_policy_mask=0.0,
                  masks=True),
    "token_mask": dict(old=False, beta=0.04, kl_bias_correction=True,
                       is_correction="token_mask", is_min=0.9, is_max=1.1,
                       sapo_tau=(0.5, 2.0)),
    # INTELLECT-2's cap, which holds one A < 0 token (_micro_batch)
    "delta": dict(epsilon_high=0.28, delta=1.5, beta=0.04, is_correction="token_truncate",
                  is_max=2.0),
}


def _takes(loss_type, options):
    """Whether LossSettings takes the option set with loss_type: vespo's ratio is
    token-level, and delta caps the clipped surrogate only."""
    o = OPTIONS[options]
    if "delta" in o and loss_type not in CLIPPED_LOSS_TYPES:
        return False
    return loss_type != "vespo" or o.get("importance_sampling_level") != "sequence"


def _settings(loss_type, settings, **fields):
    """LossSettings(loss_type, **settings, **fields) as the loss type takes them:
    luspo's ratio per sequence, vespo's IS weight per token (sequence_* ->
    token_*)."""
    settings = dict(settings, **fields)
    if loss_type == "luspo":
        settings["importance_sampling_level"] = "sequence"
    if loss_type == "vespo":
        is_correction = settings.get("is_correction", "off")
        settings["is_correction"] = is_correction.replace("sequence", "token")
    return LossSettings(loss_type=loss_type, **settings)


def _micro_batch(options, n=4, T=3, V=64, device="cpu"):
    """A micro-batch of n sequences out of a minibatch of 2n.

    It has padding, and clipped tokens on both sides. With options["masks"], it
    also has a truncated sequence (the third) and a high-entropy mask.

    -> (logits (n, T, V), the UpdateBatch, LossSettings' fields but loss_type,
    policy_loss's minibatch_size and minibatch_tokens).
    """
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(n, T, V, generator=g)).requires_grad_()  # (n, T, V)
    ids = torch.randint(V, (n, T), generator=g)  # (n, T)
    mask = torch.ones(n, T)  # (n, T)
    mask[1, 1:] = 0
    mask[3, 2] = 0
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2])  # (n,)

    temperature = options.get("temperature", 1.0)
    logps = selective_log_softmax(logits.detach(), ids, temperature)  # (n, T)
    old = logps + 0.3 * torch.randn(n, T, generator=g)
    old[0, 0] = logps[0, 0] - 1  # clipped above (A > 0)
    old[3, 0] = logps[3, 0] + 1  # clipped below (A < 0)
    if "delta" in options:
        old[1, 0] = logps[1, 0] - 1  # ratio e > delta, A < 0: capped
    ref = old + 0.3 * torch.randn(n, T, generator=g)
    sampling = old + 0.2 * torch.randn(n, T, generator=g)

    truncated = None
    high_entropy = None
    if options.get("masks"):
        truncated = torch.tensor([False, False, True, False], device=device)  # (n,)
        high = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 1, 1], [0, 1, 0]]).bool()
        high_entropy = high.to(device) & (mask.to(device) > 0)  # (n, T)

    batch = UpdateBatch(
        completion_ids=ids.to(device),
        completion_mask=mask.to(device),
        advantages=advantages.to(device),
        sampling_logps=sampling.to(device),
        old_logps=old.to(device) if options.get("old", True) else None,
        ref_logps=ref.to(device),
        truncated=truncated,
        high_entropy=high_entropy,
    )

    settings = {k: v for k, v in options.items() if k not in ("old", "masks")}
    settings["max_new_tokens"] = T + 2
    share = dict(minibatch_size=2 * n, minibatch_tokens=mask.to(device).sum() + 5)
    logits = logits.detach().to(device).requires_grad_()
    return logits, batch, settings, share


def _fp64(logits, batch, share):
    """_micro_batch's logits, UpdateBatch and share with the same numbers in
    fp64: two computations of the same math then agree to FP64_TOL."""
    def up(x):
        return x.double() if torch.is_tensor(x) and x.is_floating_point() else x

    fields = {f.name: up(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    share = {k: up(v) for k, v in share.items()}
    return logits.detach().double().requires_grad_(), UpdateBatch(**fields), share


def _inline(logits, batch, settings, *, minibatch_size, minibatch_tokens):
    """The micro-batch step spelled out with loss.py's reference pieces.

    It is what policy_loss must compute on the torch path.
    """
    s = settings
    mask = batch.completion_mask  # (n, T)

    logps = selective_log_softmax(logits, batch.completion_ids, s.temperature)  # (n, T)
    entropies = None
    if s.entropy_coef:
        entropies = entropy_from_logits(logits, s.temperature)  # (n, T)
    current = logps.detach()  # (n, T)

    ratio_old_logps = current if batch.old_logps is None else batch.old_logps
    weight, is_weight, stats = policy_weight(batch, ratio_old_logps, current, s)
    loss, metrics = grpo_loss(logps, batch.old_logps, batch.ref_logps, batch.advantages,
                              mask, s, entropies=entropies, token_weight=weight,
                              is_weight=is_weight, truncated=batch.truncated,
                              num_sequences=minibatch_size, num_items=minibatch_tokens)

    if stats:
        metrics.update(token_stats(mask, stats))
    return loss, dict(metrics, loss=loss.item(), tokens=mask.sum().item())


@pytest.mark.parametrize("loss_type, options",
                         [case for case in itertools.product(LOSS_TYPES, OPTIONS)
                          if _takes(*case)])
def test_policy_loss_torch_is_the_inline_step_bit_for_bit(loss_type, options):
    logits, batch, settings, share = _micro_batch(OPTIONS[options])
    settings = _settings(loss_type, settings, impl="torch")

    expected, expected_metrics = _inline(logits, batch, settings, **share)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    scaled, metrics = policy_loss(logits, batch, settings, **share)
    (grad,) = torch.autograd.grad(scaled, logits)

    assert torch.equal(scaled, expected) and torch.equal(grad, expected_grad)
    # names, order and values
    assert list(metrics.items()) == list(expected_metrics.items())
    if loss_type not in ("cispo", "sapo", "vespo"):  # off-policy inputs exercise clipping
        assert (metrics["clip_region"] > 0) == (batch.old_logps is not None)


TRITON_CASES = [
    ("grpo", "plain"),
    ("bnpo", "all"),
    ("dr_grpo", "on_policy_tis"),
    ("dapo", "all"),
    ("cispo", "knobs"),
    ("sapo", "knobs"),
    ("grpo", "token_mask"),
    ("cispo", "token_mask"),
    ("dapo", "delta"),
]


# intended: see test_kernel.py
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("loss_type, options", TRITON_CASES)
@pytest.mark.same_math
def test_policy_loss_triton_matches_torch(loss_type, options, monkeypatch):
    """The kernel path (under TRITON_INTERPRET=1 on CPU) reports the same
    metrics and the same gradient: the kernel in fp32 (it computes in fp32
    only) against the torch path in fp64 on the same numbers, to the kernel's
    rounding (test_kernel.kernel_tol: fp32_tol of a row's V logits, the tokens,
    and the log-probs' magnitude)."""
    pytest.importorskip("triton")
    import kernels.grpo

    # two blocks per row, and few interpreted ops
    monkeypatch.setattr(kernels.grpo, "BLOCK_V", 32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits, batch, settings, share = _micro_batch(OPTIONS[options], device=device)
    if loss_type == "cispo":
        settings["epsilon_high"] = 1.3  # the cap: some weights capped, others not

    out = {}
    inputs = {"torch": _fp64(logits, batch, share), "triton": (logits, batch, share)}
    for impl, (x, b, sh) in inputs.items():
        s = LossSettings(loss_type=loss_type, impl=impl, **settings)
        scaled, metrics = policy_loss(x, b, s, **sh)
        (grad,) = torch.autograd.grad(scaled, x)
        out[impl] = (scaled, grad, metrics)

    ref_loss, ref_grad, ref_metrics = out["torch"]
    loss, grad, metrics = out["triton"]
    logps = selective_log_softmax(logits.detach(), batch.completion_ids, s.temperature)
    tol = fp32_tol(logits.shape[-1] + batch.completion_mask.numel() + logps.abs().max().item())
    # the loss and the metrics relative to their terms' order 1 (they may cancel)
    assert_close_rel(loss, ref_loss, tol, scale=max(1.0, abs(ref_loss.item())), msg="loss")
    assert_close_rel(grad, ref_grad, tol, msg="grad")
    assert list(metrics) == list(ref_metrics)
    for key, value in ref_metrics.items():
        assert_close_rel(metrics[key], value, tol, scale=max(1.0, abs(value)), msg=key)


# intended: see test_kernel.py
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_policy_loss_takes_the_callers_logps_and_entropies(impl, monkeypatch):
    """train.py's forward may compute the log-probs and entropies itself.

    Given them, policy_loss gives the same loss, gradient and metrics bit for
    bit, and on the torch path it needs no logits.
    """
    if impl == "triton":
        pytest.importorskip("triton")
        import kernels.grpo

        monkeypatch.setattr(kernels.grpo, "BLOCK_V", 32)
    logits, batch, settings, share = _micro_batch(OPTIONS["knobs"])
    s = _settings("grpo", settings, impl=impl)
    expected, expected_metrics = policy_loss(logits, batch, s, **share)
    (expected_grad,) = torch.autograd.grad(expected, logits)

    entropies = entropy_from_logits(logits, s.temperature)  # (n, T)
    logps = None
    if impl == "torch":
        logps = selective_log_softmax(logits, batch.completion_ids, s.temperature)  # (n, T)
        logits_given = None
    else:  # the kernel computes its own log-probs
        logits_given = logits
    loss, metrics = policy_loss(logits_given, batch, s, logps=logps, entropies=entropies,
                                **share)
    (grad,) = torch.autograd.grad(loss, logits)

    assert torch.equal(loss, expected) and torch.equal(grad, expected_grad)
    assert list(metrics.items()) == list(expected_metrics.items())
    if impl == "torch":  # the bonus needs the entropies, or the logits to compute them
        with pytest.raises(ValueError, match="pass the logits"):
            policy_loss(None, batch, s, logps=logps.detach(), **share)


UNIQUE_CASES = [
    *[(*case, "torch") for case in itertools.product(LOSS_TYPES, OPTIONS) if _takes(*case)],
    ("grpo", "all", "triton"),
    ("dapo", "knobs", "triton"),
    ("grpo", "delta", "triton"),
]


# intended: see test_kernel.py
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("loss_type, options, impl", UNIQUE_CASES)
@pytest.mark.same_math
def test_unique_rows_with_counts_are_the_whole_batch(loss_type, options, impl,
                                                     monkeypatch):
    """train.py trains one row of each set of identical completions, weighed by
    its count (fast/dedup.py).

    The loss, the gradient of every distinct row's logits and the step's
    metrics are those of the whole batch, for every loss type and knob, on both
    paths. The batch runs in two parts (as two ranks), which checks the token
    counts that weigh the metrics. The torch path in fp64, to FP64_TOL; the
    kernel's (fp32 only) to its rounding, fp32_tol of a row's V logits, the 7
    rows' tokens and the log-probs' magnitude.
    """
    if impl == "triton":
        pytest.importorskip("triton")
        import kernels.grpo

        monkeypatch.setattr(kernels.grpo, "BLOCK_V", 32)
    logits, batch, settings, share = _micro_batch(OPTIONS[options])
    settings = _settings(loss_type, settings, impl=impl)
    logps = selective_log_softmax(logits.detach(), batch.completion_ids, settings.temperature)
    tol = fp32_tol(logits.shape[-1] + 7 * logps.shape[1] + logps.abs().max().item())
    if impl == "torch":
        logits, batch, _ = _fp64(logits, batch, share)
        tol = FP64_TOL

    # (N,) the whole batch: rows 0 and 2 repeat
    index = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    whole = batch.select(index)
    keep, counts = unique_rows(index, whole.completion_ids, whole.completion_mask,
                               whole.advantages)
    assert keep.tolist() == [0, 2, 3, 6] and counts.tolist() == [2, 1, 3, 1]
    tokens = minibatch_tokens(whole.completion_mask, whole.truncated)

    # rows: indices of the 4 distinct rows
    runs = {
        "whole": (batch, [index[:3], index[3:]]),
        "unique": (dataclasses.replace(batch, counts=counts), [torch.arange(2),
                                                               torch.arange(2, 4)]),
    }
    out = {}
    for name, (source, parts) in runs.items():
        loss = 0.0
        grad = 0.0
        micro_metrics = []
        for rows in parts:
            share, metrics = policy_loss(logits[rows], source.select(rows), settings,
                                         minibatch_size=7, minibatch_tokens=tokens)
            loss = loss + share
            grad = grad + torch.autograd.grad(share, logits)[0]
            micro_metrics.append(metrics)
        out[name] = (loss, grad, step_metrics(micro_metrics, [torch.tensor(1.0)]))

    loss, grad, logged = out["unique"]
    ref_loss, ref_grad, ref_logged = out["whole"]
    # the loss and the metrics relative to their terms' order 1 (they may cancel)
    assert_close_rel(loss, ref_loss, tol, scale=max(1.0, abs(ref_loss.item())), msg="loss")
    assert_close_rel(grad, ref_grad, tol, msg="grad")
    assert list(logged) == list(ref_logged)
    for key, value in ref_logged.items():
        assert_close_rel(logged[key], value, tol, scale=max(1.0, abs(value)), msg=key)


def test_unique_rows_tell_apart_prompts_masks_and_advantages():
    """Equal tokens under another prompt, another mask (a tool output) or another
    advantage (a reward that is not a function of the text) are other rows."""
    ids = torch.tensor([[5, 6], [5, 6], [5, 6], [5, 6], [5, 6]])
    prompt_row = torch.tensor([0, 0, 1, 1, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    advantages = torch.tensor([0.5, 0.5, 0.5, 0.5, -0.5])

    keep, counts = unique_rows(prompt_row, ids, mask, advantages)
    assert keep.tolist() == [0, 2, 3, 4] and counts.tolist() == [2, 1, 1, 1]


def test_choose_impl_says_why_and_settings_errors():
    assert choose_impl("auto", "cpu")[0] == "torch"
    assert choose_impl("triton", "cpu")[0] == "triton"
    assert choose_impl("auto", torch.device("cuda", 0))[0] == "triton"
    assert choose_impl("auto", "cuda:0", "sequence")[0] == "torch"
    assert choose_impl("torch", "cuda")[0] == "torch"

    assert choose_impl("auto", "cpu") == (
        "torch", "auto: no CUDA, where Triton would only interpret")
    assert choose_impl("auto", "cuda", "sequence") == (
        "torch", "auto: the kernel has no sequence-level ratio")
    assert choose_impl("auto", "cuda") == ("triton", "auto: the fused kernel on CUDA")
    assert choose_impl("torch", "cuda") == ("torch", "--loss-impl torch")
    # luspo and vespo are sequence-level, on any device
    for loss_type in ("luspo", "vespo"):
        why = f"auto: --loss-type {loss_type} is sequence-level, the kernel per token"
        assert choose_impl("auto", "cuda", "token", loss_type) == ("torch", why)
        assert choose_impl("auto", "cpu", "sequence", loss_type) == ("torch", why)
    assert choose_impl("auto", "cuda", "token", "dapo")[0] == "triton"
    with pytest.raises(ValueError, match="loss_impl"):
        choose_impl("fast", "cpu")

    # the settings take a resolved impl, and the kernel's token-level ratio only
    with pytest.raises(ValueError, match="choose_impl"):
        check_settings(LossSettings(impl="auto"))
    with pytest.raises(ValueError, match="supports --importance-sampling-level token only"):
        check_settings(LossSettings(impl="triton", importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="no per-sequence weight for --loss-type vespo"):
        check_settings(LossSettings(impl="triton", loss_type="vespo"))


# ---- the knobs: each objective and mask by hand --------------------------------

def test_cispo_by_hand():
    """Ratios 1.5, 6 and 0.5: the weight is min(ratio, eps_high = 5), a
    constant, times -A logp.

    Every token keeps a gradient (-w A), the capped one too: the clipped
    surrogate would give it none.
    """
    logps = torch.tensor([[-1.0], [-2.0], [-0.5]], requires_grad=True)
    old = logps.detach() - torch.log(torch.tensor([[1.5], [6.0], [0.5]]))
    adv = torch.tensor([1.0, 1.0, -1.0])

    settings = LossSettings(loss_type="cispo", epsilon_high=5.0)
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(3, 1), settings, num_items=3)
    assert loss.item() == pytest.approx(-(1.5 * -1.0 + 5.0 * -2.0 - 0.5 * -0.5) / 3)

    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.5], [-5.0], [0.5]]) / 3)
    assert list(m) == ["clip_high", "ratio_mean"]
    assert m["clip_high"] == pytest.approx(1 / 3)


def test_sapo_by_hand():
    """-sigmoid(tau (ratio - 1)) 4 / tau A, tau 1 for A > 0 and 1.05 otherwise.

    It reduces like grpo. The gradient is -4 A sigma (1 - sigma) ratio, which at
    ratio 1 is -A: grpo's.
    """
    ratio = torch.tensor([[1.5, 1.0], [0.5, 1.0]])
    logps = torch.zeros(2, 2, requires_grad=True)
    old = -torch.log(ratio)
    adv = torch.tensor([2.0, -1.0])
    tau = torch.tensor([[1.0], [1.05]])
    sigma = torch.sigmoid(tau * (ratio - 1))

    settings = LossSettings(loss_type="sapo")
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(2, 2), settings)
    expected = (-(sigma * 4 / tau) * adv.unsqueeze(-1)).mean()
    assert loss.item() == pytest.approx(expected.item()) and "clip_region" not in m

    loss.backward()
    # / 4: 2 sequences x 2 tokens
    grad = -4 * adv.unsqueeze(-1) * sigma * (1 - sigma) * ratio / 4
    torch.testing.assert_close(logps.grad, grad)
    # ratio 1: the plain policy gradient
    torch.testing.assert_close(logps.grad[:, 1], -adv / 4)


def test_kl_bias_correction_by_hand():
    """kl * ratio: the value at ratio 1 is k3's, and the gradient gains kl
    (d ratio / d logp = ratio): ratio (1 - e^d + kl) with d = ref - logp."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    old = torch.tensor([[-1.2, -2.0]])  # ratios e^0.2 and 1
    delta = ref - logps.detach()
    kl = torch.exp(delta) - delta - 1
    ratio = torch.exp(logps.detach() - old)
    zero = torch.zeros(1)
    mask = torch.ones(1, 2)
    settings = LossSettings(beta=0.5, kl_bias_correction=True)

    loss, m = grpo_loss(logps, old, ref, zero, mask, settings)
    assert loss.item() == pytest.approx((0.5 * kl * ratio).mean().item())
    assert m["kl"] == pytest.approx(kl.mean().item())
    loss.backward()
    torch.testing.assert_close(logps.grad, 0.5 * ratio * (1 - torch.exp(delta) + kl) / 2)

    on_policy = logps.detach().clone().requires_grad_()
    loss, _ = grpo_loss(on_policy, None, ref, zero, mask, settings)
    assert loss.item() == pytest.approx((0.5 * kl).mean().item())
    loss.backward()
    torch.testing.assert_close(on_policy.grad, 0.5 * (1 - torch.exp(delta) + kl) / 2)


def test_importance_weight_modes_by_hand():
    """Token ratios exp(old - sampling) = 0.5, 2, 4, and a masked token whose
    sampling log-prob is nonsense.

    The sequence ratio is their product over the unmasked tokens, 4, for every
    token of the sequence.
    """
    old = torch.zeros(1, 4)
    sampling = torch.tensor([[math.log(2.0), -math.log(2.0), -math.log(4.0), -50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mode, is_min, is_max -> weight at the 3 unmasked tokens, dropped tokens
    cases = {
        ("token_truncate", 0.0, 3.0): ([0.5, 2.0, 3.0], None),
        ("token_truncate", 1.0, 3.0): ([1.0, 2.0, 3.0], None),
        ("token_mask", 0.0, 3.0): ([0.5, 2.0, 0.0], [False, False, True]),
        ("token_mask", 1.0, 3.0): ([0.0, 2.0, 0.0], [True, False, True]),
        ("sequence_truncate", 0.0, 3.0): ([3.0, 3.0, 3.0], None),
        ("sequence_mask", 0.0, 3.0): ([0.0, 0.0, 0.0], [True, True, True]),
        ("sequence_mask", 0.0, 5.0): ([4.0, 4.0, 4.0], [False, False, False]),
    }

    for (mode, is_min, is_max), (weight, dropped) in cases.items():
        w, ratio, outside = importance_weight(old, sampling, mask, mode, is_min, is_max)
        torch.testing.assert_close(w[0, :3], torch.tensor(weight), msg=mode)

        expected_ratio = [0.5, 2.0, 4.0]
        if mode.startswith("sequence"):
            expected_ratio = [4.0] * 3
        torch.testing.assert_close(ratio[0, :3], torch.tensor(expected_ratio), msg=mode)

        assert (outside is None) == (dropped is None)
        if dropped is not None:
            assert outside[0, :3].tolist() == dropped, mode


def test_off_policy_keep_by_hand():
    """Drop a sequence only when A < 0 and its mean sampled KL(sampler || policy)
    exceeds delta (eq. 9)."""
    logps = torch.zeros(4, 2)
    # KL 0.5, 0.5, 0.1 and 0.5 (the 9 is masked)
    sampling = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.1, 0.1], [0.5, 9.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])

    advantages = torch.tensor([1.0, -1.0, -1.0, -1.0])
    keep = off_policy_keep(advantages, logps, sampling, mask, 0.3)
    assert keep.tolist() == [True, False, True, False]

    advantages = torch.tensor([0.0, -1.0, -1.0, -1.0])
    assert off_policy_keep(advantages, logps, sampling, mask, 0.5).all()


def test_truncated_completions_leave_the_loss():
    """A truncated sequence drops out of the loss, its KL, the entropy bonus and
    the normaliser.

    The loss is what the other sequences give alone, over the same minibatch
    count (grpo) or its kept tokens (dapo).
    """
    logps, old, ref, adv, mask, ent, _ = _gradcheck_inputs()
    truncated = torch.tensor([False, True, False, False])
    keep = ~truncated
    # loss_type: (the normaliser with the truncated sequence, and without it)
    normalisers = {
        "grpo": (dict(num_sequences=4), dict(num_sequences=4)),
        "dapo": (dict(num_items=minibatch_tokens(mask, truncated)),
                 dict(num_items=mask[keep].sum())),
    }

    for loss_type, (extra, extra_kept) in normalisers.items():
        settings = LossSettings(loss_type=loss_type, beta=0.04, entropy_coef=0.01)
        loss, _ = grpo_loss(logps, old, ref, adv, mask, settings, truncated=truncated,
                            entropies=ent, **extra)
        alone, _ = grpo_loss(logps[keep], old[keep], ref[keep], adv[keep], mask[keep],
                             settings, entropies=ent[keep], **extra_kept)
        torch.testing.assert_close(loss, alone)

    assert minibatch_tokens(mask, truncated).item() == mask.sum().item() - 3


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_minibatch_of_only_truncated_completions_has_loss_zero(loss_type):
    """--mask-truncated can drop every completion of a minibatch.

    Its token count would be 0, and the dapo-style reductions 0 / 0 = NaN (a
    run with --kl-bias-correction --mask-truncated --dynamic-sampling 3 once
    stopped at step 7 on it). The loss is 0, with zero gradient.
    """
    logps, old, ref, adv, mask, ent, _ = _gradcheck_inputs()
    logps = logps.detach().float().requires_grad_()
    truncated = torch.ones(mask.shape[0], dtype=torch.bool)

    tokens = minibatch_tokens(mask, truncated)
    assert tokens.item() == 1.0

    level = "sequence" if loss_type == "luspo" else "token"
    settings = LossSettings(loss_type=loss_type, beta=0.04, kl_bias_correction=True,
                            entropy_coef=0.01, max_new_tokens=8,
                            importance_sampling_level=level)
    loss, _ = grpo_loss(logps, old.float(), ref.float(), adv.float(), mask, settings,
                        truncated=truncated, entropies=ent.float(), num_items=tokens,
                        num_sequences=4)
    assert loss.item() == 0.0

    loss.backward()
    assert torch.equal(logps.grad, torch.zeros_like(logps))


@pytest.mark.same_math
def test_high_entropy_mask_keeps_the_top_quantile():
    """Entropies 0..9 at 10 unmasked tokens, and masked ones higher still.

    rho = 0.2 keeps the two highest, as TRL's get_high_entropy_mask (quantile
    1 - rho, tokens >= it); rho = 1 keeps all. The quantile is torch's.
    """
    entropies = torch.tensor([[0.0, 1, 2, 3, 100],
                              [4, 5, 6, 7, 100],
                              [8, 9, 100, 100, 100]])
    mask = entropies < 100
    high = high_entropy_mask(entropies, mask, 0.2)
    assert high.sum() == 2 and high[2, :2].all()
    assert torch.equal(high_entropy_mask(entropies, mask, 1.0), mask)

    values = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.3, 0.8, 1.0):
        ours = quantile_over_ranks(values.view(10, 100), torch.ones(10, 100), q)
        # the same interpolation lo + (hi - lo) f of values in [0, 1): two fp32 roundings
        assert_close_rel(ours, torch.quantile(values, q), fp32_tol(2), scale=1.0, msg=f"q={q}")

    no_token = torch.zeros(10, 100)
    assert quantile_over_ranks(values.view(10, 100), no_token, 0.5) == float("inf")


def test_knobs_fire_and_their_metrics():
    """The "knobs" option set removes some tokens with every mask and keeps
    others (or the tests above prove little), and logs each knob's metric.

    With every knob off, no new metric appears.
    """
    logits, batch, settings, share = _micro_batch(OPTIONS["knobs"])
    settings = LossSettings(loss_type="grpo", **settings)
    _, metrics = policy_loss(logits, batch, settings, **share)

    knobs = ("frac_masked_truncated", "frac_is_masked", "frac_off_policy_masked",
             "frac_low_entropy")
    for key in knobs:
        assert 0 < metrics[key] < 1, (key, metrics[key])
    # the third sequence: 3 of the 9 tokens
    assert metrics["frac_masked_truncated"] == pytest.approx(3 / 9)
    # of the 6 kept tokens, 2 are not in the top
    assert metrics["frac_low_entropy"] == pytest.approx(2 / 9)
    assert 0 < metrics["is_ratio_mean"] < metrics["is_ratio_max"]

    logits, batch, settings, share = _micro_batch(OPTIONS["plain"])
    settings = LossSettings(loss_type="grpo", **settings)
    _, plain = policy_loss(logits, batch, settings, **share)
    assert list(plain) == ["clip_low", "clip_high", "clip_region", "ratio_mean", "kl",
                           "loss", "tokens"]


def test_step_metrics_takes_the_max_of_a_max():
    micro = [
        dict(clip_low=0.5, is_ratio_max=2.0, loss=1.0, tokens=1.0),
        dict(clip_low=0.0, is_ratio_max=3.0, loss=2.0, tokens=3.0),
    ]
    logged = step_metrics(micro, [torch.tensor(1.0)])
    assert logged == dict(clip_low=0.125, is_ratio_max=3.0, loss=3.0, grad_norm=1.0)


# ---- the knobs: autograd through a naive implementation ------------------------

def _naive_weights(i, batch, settings, logp_all, old_all):
    """({t: w_t}, {t: is_t}) at sequence i's unmasked tokens: the IS weight and
    the off-policy mask, from every unmasked token of the sequence. vespo's IS
    weight goes to is_t (its phi), the others' to w_t."""
    s = settings
    ids = batch.completion_ids
    sampling = batch.sampling_logps
    all_tokens = [t for t in range(ids.shape[1]) if batch.completion_mask[i, t]]
    diffs = {t: float(old_all[t] - sampling[i, t]) for t in all_tokens}
    weights = {t: 1.0 for t in all_tokens}
    is_weights = {}

    if s.is_correction != "off":
        for t in all_tokens:
            if s.is_correction.startswith("sequence"):
                r = math.exp(sum(diffs.values()))
            else:
                r = math.exp(diffs[t])

            if s.is_correction.endswith("truncate"):
                w = min(max(r, s.is_min), s.is_max)
            else:
                w = r if s.is_min <= r <= s.is_max else 0.0
            if s.loss_type == "vespo":
                is_weights[t] = w
            else:
                weights[t] = w

    if s.off_policy_mask is not None and all_tokens:
        kl = [float(sampling[i, t] - logp_all[i, t, ids[i, t]].detach())
              for t in all_tokens]
        seq_kl = sum(kl) / len(all_tokens)
        if batch.advantages[i] < 0 and seq_kl > s.off_policy_mask:
            weights = {t: 0.0 for t in all_tokens}

    return weights, is_weights


def _naive_phi(i, batch, settings, logp_all, old_all, is_weights):
    """vespo's phi_i, in floats: log W_i = the clamped sum of sequence i's
    clamped token log-ratios and log IS weights."""
    s = settings
    ids = batch.completion_ids
    lowest = math.log(1e-8)

    log_w = 0.0
    for t in old_all:  # every unmasked token
        log_ratio = float(logp_all[i, t, ids[i, t]].detach()) - float(old_all[t])
        log_w += min(max(log_ratio, -20.0), 20.0)
        if t in is_weights:
            log_is = math.log(is_weights[t]) if is_weights[t] > 0 else -math.inf
            log_w += min(max(log_is, lowest), 20.0)
    log_w = min(max(log_w, lowest), 20.0)

    if batch.advantages[i] >= 0:
        k, lam = s.vespo_k[0], s.vespo_lambda[0]
    else:
        k, lam = s.vespo_k[1], s.vespo_lambda[1]
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def _naive_policy_loss(logits, batch, settings, *, minibatch_size, minibatch_tokens):
    """The loss of every option, token by token in plain Python over each
    sequence: none of loss.py's math (settings only carries the numbers)."""
    s = settings
    ids = batch.completion_ids
    A = batch.advantages
    mask = batch.completion_mask
    old = batch.old_logps
    truncated = batch.truncated
    high_entropy = batch.high_entropy
    logp_all = torch.log_softmax(logits / s.temperature, -1)  # (n, T, V)
    p_all = logp_all.exp()

    total = 0.0
    bonus = 0.0
    for i in range(logits.shape[0]):
        # the kept tokens, their log-probs and ratios
        dropped = truncated is not None and truncated[i]
        tokens = [t for t in range(logits.shape[1]) if mask[i, t] and not dropped]
        lp = [logp_all[i, t, ids[i, t]] for t in tokens]
        o = [lp[k].detach() if old is None else old[i, t] for k, t in enumerate(tokens)]
        ratios = [torch.exp(lp[k] - o[k]) for k in range(len(tokens))]
        if s.importance_sampling_level == "sequence" and tokens:
            seq = torch.exp(sum(lp[k] - o[k] for k in range(len(tokens))) / len(tokens))
            ratios = [seq] * len(tokens)

        # the IS weights and the off-policy mask, from every unmasked token
        old_all = {}
        for t in range(logits.shape[1]):
            if mask[i, t] and old is None:
                old_all[t] = logp_all[i, t, ids[i, t]].detach()
            elif mask[i, t]:
                old_all[t] = old[i, t]
        weights, is_weights = _naive_weights(i, batch, s, logp_all, old_all)
        if s.loss_type == "vespo":
            phi = _naive_phi(i, batch, s, logp_all, old_all, is_weights)

        # the per-token loss
        losses = []
        for k, t in enumerate(tokens):
            r = ratios[k]
            if s.loss_type == "cispo":
                pg = -min(float(r.detach()), s.epsilon_high) * A[i] * lp[k]
            elif s.loss_type == "sapo":
                tau = s.sapo_tau[0] if A[i] > 0 else s.sapo_tau[1]
                pg = -torch.sigmoid(tau * (r - 1)) * 4 / tau * A[i]
            elif s.loss_type == "vespo":
                pg = -phi * A[i] * lp[k]
            else:
                clipped = torch.clamp(r, 1 - s.epsilon_low, 1 + s.epsilon_high)
                capped = r if s.delta is None else torch.clamp(r, max=s.delta)
                pg = -torch.minimum(capped * A[i], clipped * A[i])

            w = weights[t] * (1.0 if high_entropy is None else float(high_entropy[i, t]))
            d = batch.ref_logps[i, t] - lp[k]
            kl = torch.exp(d) - d - 1
            losses.append(pg * w + s.beta * (kl * r if s.kl_bias_correction else kl))
            entropy = -(p_all[i, t] * logp_all[i, t]).sum()
            bonus = bonus + s.entropy_coef * entropy / minibatch_tokens

        # the sequence's share of the minibatch loss
        if losses and s.loss_type in ("grpo", "sapo"):
            total = total + sum(losses) / len(losses) / minibatch_size
        elif losses and s.loss_type == "dr_grpo":
            total = total + sum(losses) / (minibatch_size * s.max_new_tokens)
        elif losses and s.loss_type == "luspo":
            total = total + sum(losses) / minibatch_size
        elif losses:
            total = total + sum(losses) / minibatch_tokens

    return total - bonus


def _double(batch):
    """batch with its floating-point tensors in float64."""
    fields = {}
    for field in dataclasses.fields(batch):
        x = getattr(batch, field.name)
        if x is not None and x.is_floating_point():
            x = x.double()
        fields[field.name] = x
    return UpdateBatch(**fields)


NAIVE_OPTIONS = ("all", "on_policy_tis", "gspo", "knobs", "token_mask", "delta")


@pytest.mark.parametrize("loss_type, options",
                         [case for case in itertools.product(LOSS_TYPES, NAIVE_OPTIONS)
                          if _takes(*case)])
@pytest.mark.same_math
def test_policy_loss_matches_a_naive_implementation(loss_type, options):
    """Loss and gradient w.r.t. the logits (float64), for every loss type with
    every knob."""
    logits, batch, settings, share = _micro_batch(OPTIONS[options])
    logits = logits.detach().double().requires_grad_()
    batch = _double(batch)
    settings = _settings(loss_type, settings)
    share["minibatch_tokens"] = minibatch_tokens(batch.completion_mask, batch.truncated)

    loss, _ = policy_loss(logits, batch, settings, **share)
    (grad,) = torch.autograd.grad(loss, logits)
    naive = _naive_policy_loss(logits, batch, settings, **share)
    (naive_grad,) = torch.autograd.grad(naive, logits)

    torch.testing.assert_close(loss, naive, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, naive_grad, rtol=1e-10, atol=1e-12)
